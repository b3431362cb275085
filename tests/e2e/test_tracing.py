"""Per-request traces (deployments/tracing.py): a request's spans, each under the right parent, in the
client's trace when it sent a W3C `traceparent`.

The door runs in this process, tracing into an in-memory exporter; the router and the workers are Ray
actors, each writing its spans as JSON lines (`trace_exporter=file:...`, one file per process). The
tree is rebuilt from both."""

from __future__ import annotations

import asyncio
import glob
import json
import time

import httpx
import pytest
import ray

from deployments import tracing
from deployments.config import ServeConfig
from deployments.frontend.backend import LocalEngineBackend
from deployments.frontend.http_app import build_openai_app
from deployments.frontend.router_client import RouterBackend
from deployments.frontend.stream_hub import StreamHub
from engine import EngineConfig, LLMEngine
from helpers import FakeGrpcContext, local_ray, pdserve_router, wait_for

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}
OTHER_TRACE = "6bf92f3577b34da6a3ce929d0e0e4738"


@pytest.fixture
def memory_spans():
    """This process traces into memory while the test runs; yields the exporter."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use_provider(provider)
    try:
        yield exporter
    finally:
        tracing.use_provider(None)


async def _complete(app, body: dict, headers: dict | None = None) -> dict:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://door") as client:
        r = await client.post("/v1/completions", json=body, headers=headers or {}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _tree(spans: list[dict]) -> tuple[dict[str, list[dict]], dict[str, dict]]:
    """(spans by name, spans by id)."""
    by_name: dict[str, list[dict]] = {}
    for s in spans:
        by_name.setdefault(s["name"], []).append(s)
    return by_name, {s["span_id"]: s for s in spans}


def _one(by_name: dict[str, list[dict]], name: str, **attrs) -> dict:
    found = [s for s in by_name.get(name, []) if all(s["attributes"].get(k) == v for k, v in attrs.items())]
    assert len(found) == 1, (name, attrs, by_name.get(name))
    return found[0]


def test_tracing_is_off_by_default_and_no_request_carries_a_trace():
    assert not tracing.enabled() and tracing.current() is None and tracing.stream_started() is None
    assert tracing.start("x", {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}) is None
    cfg = ServeConfig.from_dict({})
    assert cfg.otlp_endpoint is None and cfg.trace_exporter is None
    with pytest.raises(ValueError, match="trace_exporter"):
        ServeConfig.from_dict({"trace_exporter": "stdout"})


def test_single_process_request_is_one_trace_under_the_clients_traceparent(tiny_model_dir, memory_spans):
    engine = LLMEngine(EngineConfig(model=tiny_model_dir("llama"), num_threads=1, num_kv_blocks=64, block_size=4))
    backend = LocalEngineBackend(engine)
    try:
        app = build_openai_app(backend, engine.tokenizer, "m", engine.max_model_len)
        out = asyncio.run(_complete(app, {"model": "m", "prompt": [5, 6, 7, 8, 9], "max_tokens": 4,
                                          "temperature": 0, "ignore_eos": True}, TRACEPARENT))
    finally:
        backend.shutdown()
    assert out["usage"]["completion_tokens"] == 4
    spans = [tracing.span_dict(s) for s in memory_spans.get_finished_spans()]
    by_name, _ = _tree(spans)
    root = _one(by_name, "request")
    assert root["trace_id"] == CLIENT_TRACE and root["parent_id"] == CLIENT_SPAN
    assert root["attributes"]["request_id"] == out["id"] and root["attributes"]["finish_reason"] == "length"
    for name in ("door.parse", "door.prepare", "first_token", "finish"):
        assert _one(by_name, name)["parent_id"] == root["span_id"], name
    assert _one(by_name, "door.prepare")["attributes"]["prompt_tokens"] == 5
    finish = _one(by_name, "finish")
    assert finish["start_ns"] == finish["end_ns"] and finish["attributes"].pop("stream_ms") > 0
    assert finish["attributes"] == {"finish_reason": "length", "prompt_tokens": 5, "completion_tokens": 4,
                                    "cached_tokens": 0}
    assert _one(by_name, "first_token")["attributes"]["ttft_ms"] > 0
    assert {s["trace_id"] for s in spans} == {CLIENT_TRACE}


def test_single_process_structured_request_traces_its_grammar_compile(tiny_model_dir, memory_spans):
    """A request with an output constraint: its grammar's compile (engine/grammar_waits.py) is a
    `grammar.compile` span under the request's root; the same constraint again is a cache hit."""
    engine = LLMEngine(EngineConfig(model=tiny_model_dir("llama"), num_threads=1, num_kv_blocks=64, block_size=4))
    backend = LocalEngineBackend(engine)
    body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 12, "temperature": 0, "guided_regex": "[a-c]{2}-[0-9]"}
    try:
        app = build_openai_app(backend, engine.tokenizer, "m", engine.max_model_len)
        first = asyncio.run(_complete(app, body, TRACEPARENT))
        again = asyncio.run(_complete(app, body, {"traceparent": f"00-{OTHER_TRACE}-{CLIENT_SPAN}-01"}))
    finally:
        backend.shutdown()
    assert first["choices"][0]["finish_reason"] == again["choices"][0]["finish_reason"] == "stop"
    spans = [tracing.span_dict(s) for s in memory_spans.get_finished_spans()]
    for trace_id, cache_hit in ((CLIENT_TRACE, False), (OTHER_TRACE, True)):
        by_name, _ = _tree([s for s in spans if s["trace_id"] == trace_id])
        root, grammar = _one(by_name, "request"), _one(by_name, "grammar.compile")
        assert grammar["parent_id"] == root["span_id"]
        attrs = grammar["attributes"]
        assert attrs["kind"] == "regex" and attrs["cache_hit"] is cache_hit and "error_cause" not in attrs
        assert (attrs.get("compile_s", 0) > 0) is not cache_hit  # a hit compiled nothing
        # it waited after the door prepared the request, and before its first token
        assert _one(by_name, "door.prepare")["end_ns"] <= grammar["start_ns"] <= grammar["end_ns"]
        assert grammar["end_ns"] <= _one(by_name, "first_token")["start_ns"]


def _grpc_generate(service, request, metadata: dict[str, str]) -> list:
    async def run():
        return [out async for out in service.Generate(request, FakeGrpcContext([("application", "pdserve-grpc"), *metadata.items()]))]
    return asyncio.run(run())


def test_grpc_request_is_one_trace_under_the_clients_traceparent_metadata(tiny_model_dir, memory_spans):
    """The gRPC door starts the request's trace as the HTTP door does, from W3C `traceparent` metadata;
    a call it refuses ends its root span with the status."""
    import grpc

    from deployments.frontend.grpc import pdserve_pb2
    from deployments.frontend.grpc_app import GenerationService, GRPCError, ServingState

    engine = LLMEngine(EngineConfig(model=tiny_model_dir("llama"), num_threads=1, num_kv_blocks=64, block_size=4))
    backend = LocalEngineBackend(engine)
    try:
        service = GenerationService(ServingState(backend, engine.tokenizer, "m", engine.max_model_len,
                                                 engine.vocab_size))
        chunks = _grpc_generate(service, pdserve_pb2.GenerateRequest(
            prompt_token_ids=[5, 6, 7, 8], max_tokens=3, temperature=0, ignore_eos=True), TRACEPARENT)
        with pytest.raises(GRPCError) as refused:
            _grpc_generate(service, pdserve_pb2.GenerateRequest(prompt="hi", n=0),
                           {"traceparent": f"00-{OTHER_TRACE}-{CLIENT_SPAN}-01"})
    finally:
        backend.shutdown()
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 3
    assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT
    spans = [tracing.span_dict(s) for s in memory_spans.get_finished_spans()]
    by_name, _ = _tree([s for s in spans if s["trace_id"] == CLIENT_TRACE])
    root = _one(by_name, "request")
    assert root["parent_id"] == CLIENT_SPAN and root["attributes"]["rpc.system"] == "grpc"
    assert root["attributes"]["request_id"] == chunks[-1].request_id
    assert root["attributes"]["finish_reason"] == "length"
    for name in ("door.prepare", "first_token", "finish"):
        assert _one(by_name, name)["parent_id"] == root["span_id"], name
    assert _one(by_name, "door.prepare")["attributes"]["prompt_tokens"] == 4
    assert _one(by_name, "finish")["attributes"]["completion_tokens"] == 3
    refused_root = [s for s in spans if s["trace_id"] == OTHER_TRACE]
    assert len(refused_root) == 1 and refused_root[0]["parent_id"] == CLIENT_SPAN
    assert refused_root[0]["attributes"]["error"] == "INVALID_ARGUMENT"


# ---------------------------------------------------------------------- disaggregated, across Ray actors
@pytest.fixture(scope="module")
def traced_cluster(tmp_path_factory):
    out = tmp_path_factory.mktemp("spans")
    cfg = ServeConfig.from_dict(dict(num_prefill_workers=1, num_decode_workers=2, kv_cache_memory_mb=64,
                                     max_num_seqs=8, local_prefill_max_tokens=0,
                                     trace_exporter=f"file:{out}/spans"))
    with local_ray(4, namespace="pdserve-tests"), pdserve_router(cfg) as router:
        from engine.model_loader import load_tokenizer

        info = ray.get(router.wait_ready.remote(60))
        tokenizer = load_tokenizer(cfg.engine.model, cfg.engine.dtype, cfg.engine.cache_dir)
        yield router, tokenizer, info, out


def _cluster_spans(out, trace_id: str) -> list[dict]:
    spans = []
    for path in glob.glob(f"{out}/spans.*"):
        with open(path, encoding="utf-8") as f:
            spans += [s for line in f if (s := json.loads(line))["trace_id"] == trace_id]
    return spans


def test_disaggregated_request_spans_each_under_the_right_parent(traced_cluster, memory_spans):
    router, tokenizer, info, out = traced_cluster
    backend = RouterBackend(router, StreamHub(), "hub-trace", request_timeout_s=120)
    app = build_openai_app(backend, tokenizer, "m", info.max_model_len)
    body = {"model": "m", "prompt": list(range(300, 340)), "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    result = asyncio.run(_complete(app, body, TRACEPARENT))
    assert result["usage"]["completion_tokens"] == 6

    door = [tracing.span_dict(s) for s in memory_spans.get_finished_spans()]

    def whole() -> list[dict]:
        return door + _cluster_spans(out, CLIENT_TRACE)

    spans = wait_for(whole, lambda ss: {"decode", "kv.transfer", "prefill"} <= {s["name"] for s in ss},
                     timeout_s=30, what="the workers' spans in their files")
    by_name, by_id = _tree(spans)
    root = _one(by_name, "request")
    assert root["parent_id"] == CLIENT_SPAN and {s["trace_id"] for s in spans} == {CLIENT_TRACE}
    under_root = ["door.parse", "door.prepare", "prefill", "decode.admission", "decode", "finish"]
    for name in under_root:
        assert _one(by_name, name)["parent_id"] == root["span_id"], name
    for pool in ("prefill", "decode"):
        assert _one(by_name, "router.queue", pool=pool)["parent_id"] == root["span_id"]
        assert _one(by_name, "router.place", pool=pool)["parent_id"] == root["span_id"]
    place = _one(by_name, "router.place", pool="prefill")["attributes"]
    assert place["worker"] == "pdserve-prefill-0" and place["reason"].startswith(("load", "prefix cache hit"))
    assert "free KV blocks" in _one(by_name, "router.place", pool="decode")["attributes"]["reason"]

    prefill = _one(by_name, "prefill")
    chunks = by_name["prefill.chunk"]
    assert chunks and all(c["parent_id"] == prefill["span_id"] for c in chunks)
    assert sum(c["attributes"]["step_prefill_tokens"] for c in chunks) >= 40
    assert _one(by_name, "first_token")["parent_id"] == prefill["span_id"]
    assert prefill["attributes"]["kv_bytes"] > 0 and prefill["service"] == "pdserve-prefill"

    admission = _one(by_name, "decode.admission")
    kv = _one(by_name, "kv.transfer")
    assert kv["parent_id"] == admission["span_id"]
    assert kv["attributes"]["transport"] == "gloo" and kv["attributes"]["bytes"] == prefill["attributes"]["kv_bytes"]
    assert kv["attributes"]["gbps"] > 0 and kv["attributes"]["src"] == "pdserve-prefill-0"
    decode = _one(by_name, "decode")
    assert decode["attributes"]["finish_reason"] == "length" and decode["service"] == "pdserve-decode"
    assert _one(by_name, "finish")["attributes"]["completion_tokens"] == 6
    # the order a request lives through
    assert root["start_ns"] <= prefill["start_ns"] <= kv["start_ns"] <= decode["start_ns"] <= decode["end_ns"]
    print("\n".join(_as_text(spans)))  # for the record (pytest -s): the trace as an indented tree


def test_disaggregated_structured_request_traces_each_workers_grammar_compile(traced_cluster, memory_spans):
    """Both engines a constrained request crosses compile its grammar (the prefill worker's constrains
    the first token): each compile is a `grammar.compile` span under that worker's span."""
    router, tokenizer, info, out = traced_cluster
    backend = RouterBackend(router, StreamHub(), "hub-trace-grammar", request_timeout_s=120)
    app = build_openai_app(backend, tokenizer, "m", info.max_model_len)
    trace_id = "7bf92f3577b34da6a3ce929d0e0e4739"
    body = {"model": "m", "prompt": list(range(500, 530)), "max_tokens": 8, "temperature": 0,
            "guided_regex": "(yes|no)-[0-9]"}
    result = asyncio.run(_complete(app, body, {"traceparent": f"00-{trace_id}-{CLIENT_SPAN}-01"}))
    assert result["choices"][0]["finish_reason"] == "stop" and result["choices"][0]["text"] in (
        *(f"yes-{i}" for i in range(10)), *(f"no-{i}" for i in range(10)))
    door = [tracing.span_dict(s) for s in memory_spans.get_finished_spans()]
    spans = wait_for(lambda: door + _cluster_spans(out, trace_id),
                     lambda ss: sum(s["name"] == "grammar.compile" for s in ss) == 2 and
                     any(s["name"] == "decode" for s in ss), timeout_s=30, what="both grammar.compile spans")
    by_name, by_id = _tree(spans)
    prefill, decode = _one(by_name, "prefill"), _one(by_name, "decode")
    for worker_span in (prefill, decode):
        grammar = next(s for s in by_name["grammar.compile"] if s["parent_id"] == worker_span["span_id"])
        assert grammar["service"] == worker_span["service"]
        attrs = grammar["attributes"]
        assert attrs["kind"] == "regex" and "error_cause" not in attrs
        assert attrs["cache_hit"] or attrs["compile_s"] > 0  # the decode worker may have compiled it before
    assert _one(by_name, "decode")["attributes"]["finish_reason"] == "stop"


def _as_text(spans: list[dict]) -> list[str]:
    by_parent: dict[str | None, list[dict]] = {}
    ids = {s["span_id"] for s in spans}
    for s in spans:
        by_parent.setdefault(s["parent_id"] if s["parent_id"] in ids else None, []).append(s)
    t0 = min(s["start_ns"] for s in spans)
    lines: list[str] = []

    def walk(parent: str | None, depth: int) -> None:
        for s in sorted(by_parent.get(parent, []), key=lambda s: s["start_ns"]):
            attrs = " ".join(f"{k}={v}" for k, v in s["attributes"].items())
            lines.append(f"{'  ' * depth}{s['name']} [{s['service']}] +{(s['start_ns'] - t0) / 1e6:.1f}ms "
                         f"{(s['end_ns'] - s['start_ns']) / 1e6:.1f}ms {attrs}")
            walk(s["span_id"], depth + 1)
    walk(None, 0)
    return lines


@pytest.mark.slow
def test_a_moved_sequence_shows_its_resume_in_the_trace(traced_cluster, memory_spans):
    """The decode worker running a traced request dies mid-stream: the router resumes it on the other
    one, and the trace has the `resume` span (moved, with its offset) and a second `decode`."""
    router, tokenizer, info, out = traced_cluster
    backend = RouterBackend(router, StreamHub(), "hub-trace-2", request_timeout_s=120)
    app = build_openai_app(backend, tokenizer, "m", info.max_model_len)
    trace_id = "5bf92f3577b34da6a3ce929d0e0e4737"
    headers = {"traceparent": f"00-{trace_id}-{CLIENT_SPAN}-01"}
    body = {"model": "m", "prompt": list(range(400, 440)), "max_tokens": 160, "temperature": 0, "ignore_eos": True}

    async def scenario():
        task = asyncio.create_task(_complete(app, body, headers))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            stats = await router.stats.remote()
            busy = [w for w, d in stats["decode"].items() if d["running"] > 0]
            if busy:
                ray.kill((await router.workers.remote())[busy[0]])
                break
        return await task

    result = asyncio.run(scenario())
    assert result["usage"]["completion_tokens"] == 160
    door = [tracing.span_dict(s) for s in memory_spans.get_finished_spans()]
    spans = wait_for(lambda: door + _cluster_spans(out, trace_id),
                     lambda ss: any(s["name"] == "resume" for s in ss) and any(s["name"] == "decode" for s in ss),
                     timeout_s=30, what="the resume span")
    by_name, _ = _tree(spans)
    root = _one(by_name, "request")
    resume = _one(by_name, "resume")
    assert resume["parent_id"] == root["span_id"] and resume["attributes"]["moved"] is True
    assert resume["attributes"]["offset"] > 0
    moved = [s for s in by_name["router.place"] if s["attributes"]["reason"].startswith("moved sequence")]
    assert len(moved) == 1 and moved[0]["parent_id"] == root["span_id"]
    assert _one(by_name, "decode")["attributes"]["finish_reason"] == "length"


def test_otlp_endpoint_receives_the_spans():
    """`otlp_endpoint`: spans leave as OTLP/HTTP protobuf POSTs (a local collector stands in)."""
    import http.server
    import threading

    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    got: list[bytes] = []

    class Collector(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            got.append(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert tracing.configure(f"http://127.0.0.1:{server.server_port}/v1/traces", None, "pdserve-test")
        tracing.record("router.place", TRACEPARENT, time.time_ns(), attributes={"reason": "load"})
        tracing.flush()
        names = [s.name for body in got for rs in ExportTraceServiceRequest.FromString(body).resource_spans
                 for ss in rs.scope_spans for s in ss.spans]
        assert names == ["router.place"]
    finally:
        tracing.use_provider(None)
        server.shutdown()
