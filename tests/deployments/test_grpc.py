"""The gRPC service end to end: a local Ray cluster, Serve's gRPC proxy on a free port, `GRPCIngress` over a
`LocalEngineBackend` (real SmolLM2) in a replica, and the generated `GenerationStub` as the client."""

from __future__ import annotations

import json
import socket
import time

import grpc
import pytest
import ray
from ray import serve

from deployments.frontend.grpc import pdserve_pb2, pdserve_pb2_grpc
from deployments.frontend.grpc_app import GRPCIngress, grpc_options, local_engine_factory
from engine import LLM, SamplingParams

MODEL = "smollm2"
APP = "pdserve-grpc-test"
METADATA = (("application", APP),)
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
# Small KV pools: two engines (the replica's and the reference) share 2 cores and the test's memory.
ENGINE_KW = dict(model=None, num_threads=1, kv_cache_memory_mb=128)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def reference():
    """The engine run directly (offline API), for greedy comparisons."""
    return LLM(**ENGINE_KW)


@pytest.fixture(scope="module")
def stub():
    port = _free_port()
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        serve.start(grpc_options=grpc_options(port), http_options={"host": "127.0.0.1", "port": _free_port()})
        # max_num_requests=1 lets the queue-full test fill the backend with one stream.
        factory = local_engine_factory(model_name=MODEL, max_num_requests=1, **ENGINE_KW)
        serve.run(GRPCIngress.options(ray_actor_options={"num_cpus": 1}).bind(factory), name=APP, route_prefix=f"/{APP}")
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        grpc.channel_ready_future(channel).result(timeout=60)
        client = pdserve_pb2_grpc.GenerationStub(channel)
        deadline = time.monotonic() + 60
        while True:  # the proxy learns about the app shortly after serve.run returns
            try:
                client.Health(pdserve_pb2.HealthRequest(), metadata=METADATA, timeout=10)
                break
            except grpc.RpcError as e:
                if time.monotonic() > deadline:
                    raise AssertionError(f"the gRPC app never became reachable: {e.code()} {e.details()}")
                time.sleep(0.5)
        yield client
        channel.close()
    finally:
        serve.shutdown()
        ray.shutdown()


def _generate(stub, **fields) -> list[pdserve_pb2.GenerateResponse]:
    return list(stub.Generate(pdserve_pb2.GenerateRequest(**fields), metadata=METADATA, timeout=120))


def _joined(chunks) -> tuple[str, list[int]]:
    return "".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids]


def _assert_last(chunks, finish_reason: str, num_prompt: int) -> None:
    *body, last = chunks
    assert all(not c.finish_reason and not c.HasField("usage") for c in body)
    assert last.finish_reason == finish_reason
    num_completion = sum(len(c.token_ids) for c in chunks)
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens) == (
        num_prompt, num_completion, num_prompt + num_completion)
    assert len({c.request_id for c in chunks}) == 1 and chunks[0].request_id.startswith("grpc-")


def test_chat_greedy_matches_engine(stub, reference):
    prompt_ids = reference.engine.apply_chat_template(FRANCE)
    ref = reference.generate(prompt_ids, SamplingParams(max_tokens=48, temperature=0))[0]
    assert "Paris" in ref.text
    by_messages = _generate(stub, model=MODEL, temperature=0, max_tokens=48,
                            messages=[pdserve_pb2.ChatMessage(**m) for m in FRANCE])
    by_ids = _generate(stub, temperature=0, max_tokens=48, prompt_token_ids=prompt_ids)
    for chunks in (by_messages, by_ids):
        assert _joined(chunks) == (ref.text, ref.token_ids)
        _assert_last(chunks, ref.finish_reason, len(prompt_ids))


def test_plain_prompt_streams_chunks(stub, reference):
    prompt = "The three primary colors are"
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    ref = reference.generate(prompt, params)[0]
    chunks = _generate(stub, prompt=prompt, max_tokens=24, temperature=0, ignore_eos=True)
    assert len(chunks) >= 3, "tokens should stream, not arrive in one message"
    assert _joined(chunks) == (ref.text, ref.token_ids)
    _assert_last(chunks, "length", len(reference.engine.encode_prompt(prompt)))
    assert chunks[-1].usage.completion_tokens == 24


def test_stop_string_cuts_text(stub):
    chunks = _generate(stub, temperature=0, max_tokens=48, stop=["Paris"],
                       messages=[pdserve_pb2.ChatMessage(**m) for m in FRANCE])
    text, _ = _joined(chunks)
    assert "Paris" not in text and text.startswith("The capital of France is")
    assert chunks[-1].finish_reason == "stop"


@pytest.mark.parametrize("fields, code, field", [
    (dict(), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    (dict(prompt="hi", prompt_token_ids=[1, 2]), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    (dict(prompt="hi", temperature=-1), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    (dict(prompt="hi", top_p=1.5), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    (dict(prompt="hi", max_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    (dict(prompt="hi", max_tokens=10**9), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    (dict(prompt="hi", max_tokens=4, min_tokens=8), grpc.StatusCode.INVALID_ARGUMENT, "min_tokens"),
    (dict(prompt_token_ids=[10**7]), grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids"),
    (dict(prompt="hi", model="gpt-9"), grpc.StatusCode.NOT_FOUND, "model"),
    (dict(prompt="hi", temperature=float("nan")), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    (dict(prompt="hi", top_k=2**20 + 1), grpc.StatusCode.INVALID_ARGUMENT, "top_k"),
    (dict(prompt="hi", stop=["s"] * 17), grpc.StatusCode.INVALID_ARGUMENT, "stop"),
    (dict(prompt="hi", stop_token_ids=[10**7]), grpc.StatusCode.INVALID_ARGUMENT, "stop_token_ids"),
    (dict(prompt="hi", cache_salt=""), grpc.StatusCode.INVALID_ARGUMENT, "cache_salt"),
    (dict(prompt_token_ids=[-5]), grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids"),
    ("UNKNOWN_FIELD", grpc.StatusCode.INVALID_ARGUMENT, "request"),
])
def test_bad_input_status(stub, fields, code, field):
    if fields == "UNKNOWN_FIELD":  # what a client built from a newer .proto sends: field 99, varint 1
        request = pdserve_pb2.GenerateRequest.FromString(
            pdserve_pb2.GenerateRequest(prompt="hi").SerializeToString() + bytes([0x98, 0x06, 0x01]))
    else:
        request = pdserve_pb2.GenerateRequest(**fields)
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request, metadata=METADATA, timeout=120))
    assert info.value.code() == code
    assert info.value.details().startswith(f"{field}: "), info.value.details()


def test_queue_full_then_cancel_frees_the_slot(stub):
    # The backend takes one request at a time (max_num_requests=1): hold one stream open.
    call = stub.Generate(pdserve_pb2.GenerateRequest(prompt="Count to one thousand:", max_tokens=400,
                                                     temperature=0, ignore_eos=True), metadata=METADATA, timeout=120)
    assert next(call).token_ids
    with pytest.raises(grpc.RpcError) as info:
        _generate(stub, prompt="hi", max_tokens=2)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "retry" in info.value.details()
    # A client that goes away aborts its request: the slot frees without the 400 tokens being made.
    call.cancel()
    deadline = time.monotonic() + 30
    while True:
        health = stub.Health(pdserve_pb2.HealthRequest(), metadata=METADATA, timeout=10)
        if json.loads(health.details_json)["num_requests"] == 0:
            break
        assert time.monotonic() < deadline, f"the cancelled request still holds the backend: {health.details_json}"
        time.sleep(0.2)
    assert health.status == "ok" and health.model == MODEL
    chunks = _generate(stub, prompt="hi", max_tokens=2, temperature=0, ignore_eos=True)
    assert chunks[-1].finish_reason == "length"


# ---------------------------------------------------------------------- the API key
AUTH_APP = "pdserve-grpc-auth-test"
API_KEY = "grpc-sekret"


@pytest.fixture(scope="module")
def auth_stub(stub, tiny_model_dir):
    """A second app on the same proxy: a tiny random model, with an API key."""
    factory = local_engine_factory(model_name=MODEL, model=tiny_model_dir("llama"), num_threads=1,
                                   kv_cache_memory_mb=16)
    serve.run(GRPCIngress.options(ray_actor_options={"num_cpus": 0}).bind(factory, api_key=API_KEY), name=AUTH_APP,
              route_prefix=f"/{AUTH_APP}")
    deadline = time.monotonic() + 60
    while True:
        try:
            stub.Health(pdserve_pb2.HealthRequest(), metadata=(("application", AUTH_APP),), timeout=10)
            return stub
        except grpc.RpcError as e:
            assert time.monotonic() < deadline, f"the gRPC auth app never became reachable: {e.code()} {e.details()}"
            time.sleep(0.5)


def test_api_key_is_required_as_over_http(auth_stub):
    app = ("application", AUTH_APP)
    request = pdserve_pb2.GenerateRequest(prompt="hi", max_tokens=2, ignore_eos=True)
    for extra in ((), (("authorization", "Bearer wrong"),), (("authorization", API_KEY),)):
        with pytest.raises(grpc.RpcError) as info:
            list(auth_stub.Generate(request, metadata=(app, *extra), timeout=60))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, info.value.details()
    key = ("authorization", f"Bearer {API_KEY}")
    chunks = list(auth_stub.Generate(request, metadata=(app, key), timeout=60))
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 2
    # Health: the status for anyone, the details only with the key.
    bare = auth_stub.Health(pdserve_pb2.HealthRequest(), metadata=(app,), timeout=10)
    assert (bare.status, bare.model, bare.details_json) == ("ok", "", "")
    full = auth_stub.Health(pdserve_pb2.HealthRequest(), metadata=(app, key), timeout=10)
    assert full.status == "ok" and full.model == MODEL and json.loads(full.details_json)["num_requests"] == 0
