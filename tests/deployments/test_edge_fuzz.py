"""Property-based tests of both doors (Hypothesis), in process over a `LocalEngineBackend` on a tiny
random-weight model: whatever a client sends, the answer is a 2xx or a 4xx with an OpenAI error
object (gRPC: a caller's status code), never a 5xx (INTERNAL), and the server still serves a normal
request afterwards with nothing left behind in the engine.

The bodies are searched three ways: arbitrary JSON values, objects built from the real field names
with edge values (and unknown names thrown in), and raw bytes (malformed JSON, NaN, huge integers,
deep nesting, invalid UTF-8, lone surrogates, oversized bodies). Counts are printed at the end
(`pytest -s`): cases generated, answers by status, 5xx seen (must be 0).

`PDSERVE_TEST_LAYOUT=disagg` runs the same doors over the disaggregated layout instead: a local Ray
router with a prefill worker and a decode worker of the same tiny model (every prompt through the
prefill worker and a gloo KV transfer), and "nothing left behind" is then checked on both workers.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import re
import uuid
from typing import Any

import grpc
import httpx
import pytest
from helpers import ThreadedServer, local_ray, pdserve_router, wait_for, wait_no_leaks
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deployments.config import ServeConfig
from deployments.frontend.backend import LocalEngineBackend
from deployments.frontend.router_client import RouterBackend
from deployments.frontend.stream_hub import StreamHub
from deployments.frontend.grpc import pdserve_pb2
from deployments.frontend.grpc_app import GenerationService, GRPCError, ServingState
from deployments.frontend.http_app import build_openai_app
from engine import EngineConfig, LLMEngine

MODEL = "tiny"
API_KEY = "fuzz-key"
SETTINGS = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck))
STATS: collections.Counter = collections.Counter()  # "http 400", "grpc INVALID_ARGUMENT", "5xx", ...
# "single" (default): one engine in this process; "disagg": the Ray router with a prefill and a decode pool.
LAYOUT = os.environ.get("PDSERVE_TEST_LAYOUT", "single")
CALLER_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAUTHENTICATED,
                grpc.StatusCode.RESOURCE_EXHAUSTED}


# ---------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine(EngineConfig(model=tiny_model_dir("llama"), num_threads=1, kv_cache_memory_mb=32))


@pytest.fixture(scope="module")
def backend(engine, tiny_model_dir):
    if LAYOUT == "disagg":
        cfg = ServeConfig.from_dict(dict(model=tiny_model_dir("llama"), num_prefill_workers=1, num_decode_workers=1,
                                         num_threads=1, kv_cache_memory_mb=32, local_prefill_max_tokens=0))
        with local_ray(4, namespace="pdserve-tests"), pdserve_router(cfg) as router:
            hub = StreamHub()
            yield RouterBackend(router, hub, f"hub-{uuid.uuid4().hex[:8]}", request_timeout_s=120.0)
            hub.shutdown()
    else:
        be = LocalEngineBackend(engine, max_num_requests=64)
        yield be
        be.shutdown()
    sent = {k: v for k, v in sorted(STATS.items()) if k.startswith(("http ", "grpc ")) and k != "grpc unparsable"}
    print(f"\n[edge fuzz] cases sent: {sum(sent.values())} (HTTP {sum(v for k, v in sent.items() if k[0] == 'h')}, "
          f"gRPC {sum(v for k, v in sent.items() if k[0] == 'g')}); by answer: {sent}; gRPC byte strings that do "
          f"not parse (never sent): {STATS['grpc unparsable']}; 5xx seen: {STATS['5xx']}; clients that vanished "
          f"mid-request: {STATS['vanished cancelled'] + STATS['vanished disconnected']} (left behind: 0 each)")


@pytest.fixture(scope="module")
def http(engine, backend):
    with ThreadedServer(build_openai_app(backend, engine.tokenizer, MODEL, engine.max_model_len,
                                         vocab_size=engine.vocab_size)) as srv:
        with httpx.Client(base_url=srv.url, timeout=60) as client:
            yield client


@pytest.fixture(scope="module")
def service(engine, backend):
    return GenerationService(ServingState(backend, engine.tokenizer, MODEL, engine.max_model_len, engine.vocab_size),
                             api_key=API_KEY)


def in_flight(backend: LocalEngineBackend | RouterBackend) -> int:
    """Requests the backend still streams (the router's layout: the hub's open streams)."""
    return backend.hub.num_streams() if isinstance(backend, RouterBackend) else backend.num_requests


def assert_still_serving(http: httpx.Client, backend: LocalEngineBackend | RouterBackend) -> None:
    r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    if isinstance(backend, RouterBackend):
        wait_for(lambda: in_flight(backend) == 0, timeout_s=30, interval_s=0.05, what="every stream closed")
        wait_no_leaks(backend.router, timeout_s=60)  # every worker: no request, no block, integrity checked
        return

    def idle() -> bool:
        busy = backend.run_on_engine(lambda e: e.has_unfinished_requests()).result(timeout=30)
        return not busy and backend.num_requests == 0

    wait_for(idle, timeout_s=10, interval_s=0.05, what="every request ended")

    def used_blocks(e: LLMEngine) -> int:
        e.check_integrity()
        return e.block_manager.num_used_blocks

    assert backend.run_on_engine(used_blocks).result(timeout=30) == 0


# ---------------------------------------------------------------------- the HTTP door
def check_http(http: httpx.Client, path: str, content: bytes) -> None:
    """Post `content`; the answer must be 2xx, or 4xx with an OpenAI error object."""
    with http.stream("POST", path, content=content, headers={"Content-Type": "application/json"}) as r:
        body = r.read()
    STATS[f"http {r.status_code}"] += 1
    if r.status_code >= 500:
        STATS["5xx"] += 1
    assert r.status_code in (200, 400, 404, 413), (r.status_code, body[:500], content[:300])
    if r.status_code != 200:
        err = json.loads(body)["error"]
        assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str), err
        assert err["type"] == "invalid_request_error", err
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        # SSE ends a line at CR or LF only; the server also escapes U+0085/U+2028/U+2029, which
        # str.splitlines() would split at, so a naive client's split is checked too.
        lines = re.split(r"\r\n|\r|\n", body.decode())
        assert lines == [ln for part in lines for ln in (part.splitlines() or [""])], "a raw line separator"
        events = [line[6:] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]", events[-3:]
        chunks = [json.loads(e) for e in events[:-1]]
        if any("error" in c for c in chunks):  # an in-band failure is a 5xx in all but the status
            STATS["5xx"] += 1
            raise AssertionError(f"in-band error: {chunks[-1]} for {content[:300]!r}")
    else:
        assert json.loads(body)["choices"][0]["finish_reason"] in ("stop", "length"), body[:300]


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
                    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
                    max_leaves=16)
INTS = st.sampled_from([0, 1, -1, 2, 2**31 - 1, 2**31, -2**31, -2**31 - 1, 2**63, 2**64 - 1, 2**64, -2**63 - 1,
                        2**20, 2**20 + 1, 49151, 49152, 10**30]) | st.integers(-3, 40)
SMALL_MAX = st.integers(-1, 6) | st.sampled_from([0, 2**31, 10**9, True, 2.0, None])
FLOATS = st.sampled_from([0.0, -0.0, 1e-9, 1e-5, 0.5, 1.0, 1.5, 99.9, 100.0, 100.5, 1e308, 5e-324, -1.0]) | \
    st.floats(allow_nan=False, allow_infinity=False)
TEXT = st.text(max_size=24)
ANY = INTS | FLOATS | TEXT | st.booleans() | st.none() | JSON
TOKEN_IDS = st.lists(st.integers(0, 49151) | INTS, min_size=0, max_size=12)
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", ""]) | TEXT},
                                optional={"content": TEXT | st.lists(st.fixed_dictionaries(
                                    {"type": st.just("text") | TEXT, "text": TEXT}), max_size=2) | ANY,
                                          "name": st.none() | TEXT, "tool_calls": st.just([]) | ANY})
FIELDS = {
    "model": st.just(MODEL) | TEXT | ANY, "temperature": FLOATS | ANY, "top_p": FLOATS | ANY, "top_k": INTS | ANY,
    "seed": INTS | ANY, "stop": TEXT | st.lists(TEXT, max_size=18) | ANY,
    "stop_token_ids": TOKEN_IDS | ANY, "n": st.sampled_from([1, 2, 0, None]) | ANY, "stream": st.booleans() | ANY,
    "stream_options": st.none() | st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | ANY}),
    "user": TEXT | ANY, "metadata": st.dictionaries(TEXT, TEXT, max_size=3) | ANY, "ignore_eos": st.booleans() | ANY,
    "min_tokens": INTS | ANY, "priority": INTS | ANY, "cache_salt": TEXT | ANY,
    "presence_penalty": st.sampled_from([0, 0.0, 0.5, False]) | ANY, "logit_bias": st.just({}) | ANY,
    "logprobs": st.sampled_from([None, False, True, 0, 5]), "response_format": st.just({"type": "text"}) | ANY,
    "min_p": FLOATS, "echo": st.booleans(), "best_of": INTS, "tools": st.just([]) | ANY,
}
UNKNOWN = st.dictionaries(st.text(min_size=1, max_size=12).filter(lambda k: k not in FIELDS), ANY, max_size=1)


VOCAB = 49152  # the tiny model's (SmolLM2's tokenizer)
SOME_TEXT = st.text(st.characters(codec="utf-8"), min_size=1, max_size=24)
VALID = {
    "model": st.sampled_from([MODEL, None]),
    "temperature": st.floats(0, 100) | st.sampled_from([0, 1e-9, 100]),
    "top_p": st.floats(1e-9, 1) | st.just(1),
    "top_k": st.integers(-1, 2**20),
    "seed": st.integers(-2**63, 2**64 - 1) | st.none(),
    "stop": SOME_TEXT | st.lists(SOME_TEXT, max_size=4),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=4),
    "n": st.just(1), "stream": st.booleans(), "user": TEXT,
    "metadata": st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3),
    "ignore_eos": st.booleans(), "min_tokens": st.integers(0, 2), "priority": st.integers(-2**31, 2**31 - 1),
    "cache_salt": SOME_TEXT, "presence_penalty": st.just(0), "logit_bias": st.just({}), "logprobs": st.none(),
    "response_format": st.just({"type": "text"}), "min_p": st.just(0), "tools": st.just([]),
}
VALID_PROMPT = SOME_TEXT | st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)
VALID_MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                                 "content": SOME_TEXT}), min_size=1, max_size=3)


@st.composite
def bodies(draw) -> tuple[str, bytes]:
    """A valid body with 0-2 fields set to anything (and sometimes an unknown field)."""
    chat = draw(st.booleans())
    body: dict[str, Any] = draw(st.fixed_dictionaries({}, optional=VALID))
    if chat:
        body["messages"] = draw(VALID_MESSAGES)
        body[draw(st.sampled_from(["max_tokens", "max_completion_tokens"]))] = draw(st.integers(2, 6))
    else:
        body["prompt"] = draw(VALID_PROMPT)
        body["max_tokens"] = draw(st.integers(2, 6))
    if body.get("stream"):
        body["stream_options"] = draw(st.none() | st.fixed_dictionaries({"include_usage": st.booleans()}))
    for name in draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=2, unique=True)):
        body[name] = draw(FIELDS[name])
    if draw(st.integers(0, 9)) == 0:
        body["messages" if chat else "prompt"] = draw(st.lists(MESSAGE, max_size=3) if chat else (
            TEXT | TOKEN_IDS | st.lists(TEXT, max_size=2) | st.lists(TOKEN_IDS, max_size=2) | ANY))
    if draw(st.integers(0, 9)) == 0:
        body.update(draw(UNKNOWN))
    return ("/v1/chat/completions" if chat else "/v1/completions"), json.dumps(body).encode()


@settings(max_examples=1500, **SETTINGS)
@given(case=bodies())
def test_any_field_values_get_2xx_or_4xx(http, case):
    check_http(http, *case)


@settings(max_examples=300, **SETTINGS)
@given(value=JSON, chat=st.booleans())
def test_any_json_value_gets_2xx_or_4xx(http, value, chat):
    check_http(http, "/v1/chat/completions" if chat else "/v1/completions", json.dumps(value).encode())


RAW = st.one_of(
    st.binary(max_size=64),
    st.sampled_from([b"", b"{", b"[]", b"null", b'"x"', b"{}", b'{"prompt": NaN}',
                     b'{"prompt": "hi", "top_p": Infinity}', b'{"prompt": "hi", "max_tokens": ' + b"7" * 5000 + b"}",
                     b'{"prompt": "\\ud800"}', b'{"prompt": "\\udfff\\ud800", "max_tokens": 1}',
                     b'{"prompt": "\xc3\x28"}', b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
                     b'{"prompt": "hi"' + b" " * (4 << 20) + b"}", b'{"prompt": "hi", "prompt": [1], "max_tokens": 1}',
                     b"\xef\xbb\xbf{}"]),
    st.builds(lambda key, esc: b'{"' + key + b'": "a\\u' + esc + b'", "max_tokens": 1}',
              st.sampled_from([b"prompt", b"user", b"model", b"cache_salt", b"stop", b"x\\ud800"]),
              st.sampled_from([b"d800", b"dbff", b"dc00", b"0000", b"ffff", b"zzzz"])),
    st.builds(lambda depth, inner: b'{"messages": ' + b"[" * depth + inner + b"]" * depth + b"}",
              st.integers(1, 3000), st.sampled_from([b"", b"1", b'{"role": "user"}'])),
)


@settings(max_examples=400, **SETTINGS)
@given(raw=RAW, chat=st.booleans())
def test_any_bytes_get_2xx_or_4xx(http, raw, chat):
    check_http(http, "/v1/chat/completions" if chat else "/v1/completions", raw)


def test_http_still_serves_with_nothing_left_behind(http, backend):
    assert_still_serving(http, backend)


# ---------------------------------------------------------------------- the gRPC door
class FakeContext:
    """What GenerationService uses of Serve's RayServegRPCContext."""

    def __init__(self, metadata: list[tuple[str, str]]):
        self.metadata = metadata
        self.code: grpc.StatusCode | None = None

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return self.metadata

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details


def check_grpc(service: GenerationService, request: pdserve_pb2.GenerateRequest, key: str | None) -> None:
    ctx = FakeContext([("application", "x")] + ([("authorization", key)] if key is not None else []))

    async def run() -> list[pdserve_pb2.GenerateResponse]:
        return [out async for out in service.Generate(request, ctx)]

    try:
        chunks = asyncio.run(run())
    except GRPCError as e:
        STATS[f"grpc {e.code.name}"] += 1
        if e.code not in CALLER_CODES:
            STATS["5xx"] += 1
        assert e.code in CALLER_CODES and ctx.code == e.code, (e.code, e.message, request)
        return
    STATS["grpc OK"] += 1
    assert chunks and chunks[-1].finish_reason in ("stop", "length"), chunks[-1:]


I32 = st.integers(-2**31, 2**31 - 1)
F32 = st.floats(width=32) | st.sampled_from([0.0, 1.0, 1e-9, 100.0, 100.5, float("nan"), float("inf")])
VALID_GRPC = {
    "model": st.sampled_from(["", MODEL]), "temperature": st.floats(0, 100, width=32),
    "top_p": st.floats(0.5 ** 20, 1, width=32), "top_k": st.integers(-1, 2**20), "seed": st.integers(-2**63, 2**63 - 1),
    "stop": st.lists(SOME_TEXT, max_size=4), "ignore_eos": st.booleans(), "min_tokens": st.integers(0, 2),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=4), "priority": I32, "cache_salt": SOME_TEXT,
}
ANY_GRPC = {
    "model": TEXT, "temperature": F32, "top_p": F32, "top_k": I32, "max_tokens": I32, "min_tokens": I32,
    "stop": st.lists(TEXT, max_size=18), "stop_token_ids": st.lists(I32, max_size=66),
    "cache_salt": st.text(max_size=3) | st.just("s" * 1025), "prompt_token_ids": st.lists(I32, max_size=8),
    "prompt": TEXT, "messages": st.lists(st.builds(pdserve_pb2.ChatMessage, role=TEXT, content=TEXT), max_size=2),
}


@st.composite
def grpc_requests(draw) -> pdserve_pb2.GenerateRequest:
    """A valid request with 0-2 fields set to any value of their type."""
    fields: dict[str, Any] = draw(st.fixed_dictionaries({}, optional=VALID_GRPC))
    form = draw(st.sampled_from(["prompt", "prompt_token_ids", "messages"]))
    fields[form] = draw({"prompt": SOME_TEXT, "prompt_token_ids": st.lists(st.integers(0, VOCAB - 1), min_size=1,
                                                                              max_size=12),
                         "messages": st.lists(st.builds(pdserve_pb2.ChatMessage, role=st.just("user"),
                                                        content=SOME_TEXT), min_size=1, max_size=2)}[form])
    fields["max_tokens"] = draw(st.integers(2, 6))
    for name in draw(st.lists(st.sampled_from(sorted(ANY_GRPC)), max_size=2, unique=True)):
        fields[name] = draw(ANY_GRPC[name])
    return pdserve_pb2.GenerateRequest(**fields)


KEYS = st.sampled_from([f"Bearer {API_KEY}"] * 6 + [None, "Bearer nope", API_KEY, "bearer  " + API_KEY])


@settings(max_examples=1000, **SETTINGS)
@given(request=grpc_requests(), key=KEYS)
def test_any_grpc_request_gets_a_caller_status_or_a_stream(service, request, key):
    check_grpc(service, request, key)


@settings(max_examples=300, **SETTINGS)
@given(raw=st.binary(max_size=80), key=KEYS)
def test_any_grpc_bytes_get_a_caller_status_or_a_stream(service, raw, key):
    try:
        request = pdserve_pb2.GenerateRequest.FromString(raw)
    except Exception:  # noqa: BLE001 - the proxy never hands over what does not parse
        STATS["grpc unparsable"] += 1
        return
    check_grpc(service, request, key)


# ---------------------------------------------------------------------- clients that vanish
@pytest.fixture(scope="module")
def asgi_app(engine, backend):
    return build_openai_app(backend, engine.tokenizer, MODEL, engine.max_model_len, vocab_size=engine.vocab_size)


@settings(max_examples=80, **SETTINGS)
@given(delay=st.floats(0, 0.05), stream=st.booleans(), chat=st.booleans(), cancel=st.booleans())
def test_a_client_that_vanishes_at_any_moment_leaves_nothing(asgi_app, backend, delay, stream, chat, cancel):
    """The handler is cancelled (as Serve does) or told the client disconnected, at any moment: before
    the body is read, while the request is submitted, queued or streaming. Nothing stays behind."""
    body = {"model": MODEL, "max_tokens": 200, "ignore_eos": True, "stream": stream,
            **({"messages": [{"role": "user", "content": "Count"}]} if chat else {"prompt": "Count"})}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 80)}

    async def drive() -> None:
        gone = asyncio.Event()
        messages = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

        async def receive():
            if messages:
                return messages.pop()
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            if gone.is_set() and not cancel:
                raise OSError("the client is gone")  # what a server does when writing to a closed socket

        task = asyncio.create_task(asgi_app(scope, receive, send))
        await asyncio.sleep(delay)
        STATS["vanished " + ("cancelled" if cancel else "disconnected")] += 1
        if cancel:
            task.cancel()
        gone.set()
        await asyncio.gather(task, return_exceptions=True)
        # NOTE: checked while this loop still runs: its shutdown would close forgotten generators.
        for _ in range(1000):
            if in_flight(backend) == 0:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"the request was not aborted ({in_flight(backend)} in flight)")

    asyncio.run(drive())


def test_grpc_still_serves_with_nothing_left_behind(http, service, backend):
    check_grpc(service, pdserve_pb2.GenerateRequest(prompt="Hello", max_tokens=3, ignore_eos=True), f"Bearer {API_KEY}")
    assert_still_serving(http, backend)
    assert STATS["5xx"] == 0
