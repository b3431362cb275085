"""A request can fail only itself: innocent greedy streams run while bad, extreme and vanishing
requests of every kind are thrown in through both doors, and every innocent stream still equals its
reference (the engine alone) token for token; every bad request gets its own error; the extreme but
valid ones finish normally; nothing is left behind.

In process: one `LocalEngineBackend` on a tiny random-weight model, the HTTP app under uvicorn on
127.0.0.1, the gRPC service driven directly. The figures are printed at the end (`pytest -s`).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import grpc
import httpx
import pytest
import torch
from helpers import ThreadedServer, wait_for

from deployments.frontend.backend import LocalEngineBackend
from deployments.frontend.grpc import pdserve_pb2
from deployments.frontend.grpc_app import GenerationService, GRPCError, ServingState
from deployments.frontend.http_app import build_openai_app
from engine import EngineConfig, LLMEngine, SamplingParams

MODEL = "tiny"
NUM_TOKENS = 160  # long enough that the innocent streams outlast the poison
NUM_HTTP_INNOCENTS, NUM_GRPC_INNOCENTS = 8, 4


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    # "priority": the extreme but valid requests carry priorities (under fcfs those are refused)
    return LLMEngine(EngineConfig(model=tiny_model_dir("llama"), num_threads=2, kv_cache_memory_mb=64,
                                  scheduling_policy="priority"))


@pytest.fixture(scope="module")
def backend(engine):
    be = LocalEngineBackend(engine)
    yield be
    be.shutdown()


def _ids(seed: int, n: int, vocab: int) -> list[int]:
    return [int(t) for t in torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))]


def _reference(backend: LocalEngineBackend, prompt_ids: list[int]) -> list[int]:
    """Greedy tokens of the engine alone, on its own thread, nothing else running."""
    def run(eng: LLMEngine) -> list[int]:
        eng.add_request("reference", prompt_ids, SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True))
        while True:
            for out in eng.step():
                if out.request_id == "reference" and out.finished:
                    return list(out.token_ids)
    return backend.run_on_engine(run).result(timeout=120)


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


def _nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def _bad_http(engine: LLMEngine) -> list[tuple[str, bytes, int, str | None]]:
    """(path, body, status, param) of requests that must fail, each with its own error."""
    v, L = engine.vocab_size, engine.max_model_len

    def j(**body: Any) -> bytes:
        return json.dumps({"model": MODEL, "max_tokens": 4, **body}).encode()

    c, cc = "/v1/completions", "/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]
    return [
        (c, j(prompt="hi", temperature=-1), 400, "temperature"), (c, j(prompt="hi", top_p=0), 400, "top_p"),
        (c, j(prompt="hi", top_k=2**20 + 1), 400, "top_k"), (c, j(prompt="hi", seed=2**64), 400, "seed"),
        (c, j(prompt=[1, v]), 400, "prompt"), (c, j(prompt=[5] * L), 400, "prompt"),
        (c, j(prompt="hi", stop_token_ids=[v]), 400, "stop_token_ids"), (c, j(prompt="hi", max_tokens=L), 400,
                                                                          "max_tokens"),
        (c, j(prompt="hi", min_tokens=9), 400, "min_tokens"), (c, j(prompt="hi", priority=2**31), 400, "priority"),
        (c, j(prompt="hi", cache_salt=""), 400, "cache_salt"), (c, j(prompt="hi", stop=["x"] * 17), 400, "stop"),
        (c, j(prompt="hi", logit_bias={"5": 101}), 400, "logit_bias"), (c, j(prompt="hi", n=17), 400, "n"),
        (cc, j(messages=msgs, tools=[{"type": "function"}]), 400, "tools"),
        (cc, j(messages=msgs, response_format={"type": "json_schema"}), 400, "response_format"),
        (cc, j(messages=msgs, response_format=_schema_format({"type": "string", "maxLength": 1e12})), 400,
         "response_format"),
        (cc, j(messages=msgs, response_format=_schema_format(_nested_schema(250))), 400, "response_format"),
        (cc, j(messages=msgs, frequency_penalty=3), 400, "frequency_penalty"),
        (c, j(prompt="hi", max_token=3), 400, "max_token"), (c, j(prompt="hi", model="gpt-x"), 404, "model"),
        (c, b'{"prompt": "hi", "temperature": NaN}', 400, None),
        (c, b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", 400, None),
        (c, b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None),
        (c, b'{"prompt": "\xff"}', 400, None), (c, b'{"prompt": "\\ud800"}', 400, "prompt"),
        (c, b'{"prompt": "' + b"x" * (5 << 20) + b'"}', 413, None), (cc, b"[]", 400, None),
    ]


def _extreme_http(engine: LLMEngine, innocent_prompt: list[int]) -> list[dict[str, Any]]:
    """Valid bodies at the edges of every range: they must finish normally ("stop" or "length")."""
    v, L = engine.vocab_size, engine.max_model_len
    eos = engine.tokenizer.eos_token_id
    return [
        dict(prompt="Hello there", temperature=100, seed=2**64 - 1, max_tokens=30),
        dict(prompt="Hello there", temperature=100, top_k=2**20, seed=-2**63, max_tokens=30),
        dict(prompt="Hello there", top_p=1e-30, max_tokens=30),
        dict(prompt="Hello there", temperature=50, top_k=1, max_tokens=30),
        dict(prompt=[v - 1, 0, v - 1], temperature=1e-9, max_tokens=30),
        dict(prompt="Hello", min_tokens=20, max_tokens=20, stop_token_ids=[eos] + list(range(63))),
        dict(prompt="Hello", max_tokens=30, stop=["".join(chr(0x4E00 + (i * 7 + k) % 2000) for k in range(512))
                                                  for i in range(16)]),
        dict(prompt="Hello", max_tokens=30, stop=list("aeiou tnsrl.,!?")),
        dict(prompt=_ids(7, L - 1, v), max_tokens=1),
        dict(prompt=innocent_prompt, max_tokens=30, cache_salt="s" * 1024, temperature=0),
        dict(prompt=innocent_prompt, max_tokens=30, priority=-2**31, temperature=0.7, seed=1),
        dict(prompt="Hello", max_tokens=30, priority=2**31 - 1, stream=True, stream_options={"include_usage": True}),
        dict(messages=[{"role": "user", "content": "\u0000\u200b🎉 x" * 20}], max_completion_tokens=20),
    ]


class _Ctx:
    def __init__(self):
        self.code = None

    def invocation_metadata(self):
        return []

    def set_code(self, code):
        self.code = code

    def set_details(self, details):
        pass


def _grpc(service: GenerationService, request: pdserve_pb2.GenerateRequest, stop_after: int | None = None):
    """All chunks, or the GRPCError; `stop_after`: the client goes away after that many chunks."""
    async def run():
        chunks = []
        gen = service.Generate(request, _Ctx())
        try:
            async for out in gen:
                chunks.append(out)
                if stop_after is not None and len(chunks) >= stop_after:
                    break
        finally:
            await gen.aclose()
        return chunks

    try:
        return asyncio.run(run())
    except GRPCError as e:
        return e


class PoisonRun:
    """One run: innocent streams in threads, then the poison while they are all running."""

    def __init__(self, engine: LLMEngine, backend: LocalEngineBackend, http: httpx.Client, url: str):
        v = engine.vocab_size
        self.prompts = [_ids(100 + i, 12 + 5 * i, v) for i in range(NUM_HTTP_INNOCENTS + NUM_GRPC_INNOCENTS)]
        self.service = GenerationService(ServingState(backend, engine.tokenizer, MODEL, engine.max_model_len, v,
                                                      "priority"))
        self.http, self.url = http, url
        self.bad, self.extreme = _bad_http(engine), _extreme_http(engine, self.prompts[0])
        self.first_chunks = threading.Barrier(len(self.prompts) + 1, timeout=120)
        self.results: dict[str, Any] = {}
        self.ended: list[float] = []  # when each innocent stream ended
        self.poison_ended: list[float] = []  # when each poison job ended

    def innocent_http(self, i: int) -> None:
        body = {"model": MODEL, "prompt": self.prompts[i], "max_tokens": NUM_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        events = []
        with self.http.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 1:
                        self.first_chunks.wait()
        chunks = [json.loads(e) for e in events[:-1]]
        self.results[f"innocent {i}"] = ("".join(c["choices"][0]["text"] for c in chunks if c["choices"]),
                                         chunks[-1]["usage"]["completion_tokens"], events[-1])
        self.ended.append(time.monotonic())

    def innocent_grpc(self, i: int) -> None:
        chunks: list = []

        async def run():
            request = pdserve_pb2.GenerateRequest(prompt_token_ids=self.prompts[i], max_tokens=NUM_TOKENS,
                                                  temperature=0, ignore_eos=True)
            async for out in self.service.Generate(request, _Ctx()):
                chunks.append(out)
                if len(chunks) == 1:
                    await asyncio.to_thread(self.first_chunks.wait)

        asyncio.run(run())
        self.results[f"innocent {i}"] = [t for c in chunks for t in c.token_ids]
        self.ended.append(time.monotonic())

    def poison_jobs(self) -> list[Callable[[], Any]]:
        put, svc = self.results.__setitem__, self.service
        jobs: list[Callable[[], Any]] = []
        for k, (path, body, *_) in enumerate(self.bad):
            jobs.append(lambda k=k, path=path, body=body: put(f"bad {k}", self.http.post(path, content=body)))
        for k, body in enumerate(self.extreme):
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            jobs.append(lambda k=k, path=path, body=body: put(f"extreme {k}", self.http.post(
                path, json={"model": MODEL, **body})))
        unknown_field = pdserve_pb2.GenerateRequest(prompt="hi").SerializeToString() + bytes([0x98, 0x06, 0x01])
        return jobs + [
            lambda: _disconnect_stream(self.url), lambda: _disconnect_waiting(self.url),
            lambda: put("grpc bad nan", _grpc(svc, pdserve_pb2.GenerateRequest(prompt="hi", temperature=float("nan")))),
            lambda: put("grpc bad unknown field", _grpc(svc, pdserve_pb2.GenerateRequest.FromString(unknown_field))),
            lambda: put("grpc extreme", _grpc(svc, pdserve_pb2.GenerateRequest(
                prompt="hi", max_tokens=20, temperature=100, top_k=1 << 20, seed=-2**63, priority=-2**31,
                cache_salt="x" * 1024))),
            lambda: _grpc(svc, pdserve_pb2.GenerateRequest(prompt="hi", max_tokens=200, ignore_eos=True), 1)]

    def run(self) -> None:
        n = NUM_HTTP_INNOCENTS
        threads = [threading.Thread(target=self.innocent_http if i < n else self.innocent_grpc, args=(i,))
                   for i in range(len(self.prompts))]
        for t in threads:
            t.start()
        self.first_chunks.wait()  # every innocent stream is running now
        with ThreadPoolExecutor(8) as pool:
            for f in [pool.submit(job) for job in self.poison_jobs()]:
                f.result(timeout=300)
                self.poison_ended.append(time.monotonic())
        for t in threads:
            t.join(300)


def test_innocent_streams_are_untouched_by_poison(engine, backend):
    app = build_openai_app(backend, engine.tokenizer, MODEL, engine.max_model_len, vocab_size=engine.vocab_size,
                           scheduling_policy="priority")
    with ThreadedServer(app) as srv, httpx.Client(base_url=srv.url, timeout=120) as http:
        run = PoisonRun(engine, backend, http, srv.url)
        refs = [_reference(backend, p) for p in run.prompts]
        run.run()
    res, tok = run.results, engine.tokenizer
    wants = [ref if i >= NUM_HTTP_INNOCENTS else (tok.decode(ref, skip_special_tokens=True), NUM_TOKENS, "[DONE]")
             for i, ref in enumerate(refs)]
    failed_innocents = [(i, res.get(f"innocent {i}"), want) for i, want in enumerate(wants)
                        if res.get(f"innocent {i}") != want]
    wrong_errors = [(k, body[:80], res[f"bad {k}"].status_code, res[f"bad {k}"].text[:200])
                    for k, (_, body, status, param) in enumerate(run.bad)
                    if not _own_error(res[f"bad {k}"], status, param)]
    grpc_bad = [res["grpc bad nan"], res["grpc bad unknown field"]]
    extreme_failed = [(k, res[f"extreme {k}"].text[:300]) for k in range(len(run.extreme))
                      if not _finished_normally(res[f"extreme {k}"])]
    overlap = sum(t < min(run.ended) for t in run.poison_ended)
    print(f"\n[poison] innocent streams: {len(refs)} (HTTP {NUM_HTTP_INNOCENTS}, gRPC {NUM_GRPC_INNOCENTS}), "
          f"failed: {len(failed_innocents)}; bad requests: {len(run.bad) + len(grpc_bad)}, without their own error: "
          f"{len(wrong_errors)}; extreme valid requests: {len(run.extreme) + 1}, not finished normally: "
          f"{len(extreme_failed)}; client disconnects: 3; poison jobs that ended while every innocent stream "
          f"still ran: {overlap} of {len(run.poison_ended)}")
    assert overlap >= len(run.poison_ended) // 2, "the poison should arrive while the innocent streams run"
    assert not failed_innocents, failed_innocents[:2]
    assert not wrong_errors, wrong_errors
    assert all(isinstance(e, GRPCError) and e.code == grpc.StatusCode.INVALID_ARGUMENT for e in grpc_bad), grpc_bad
    assert not extreme_failed, extreme_failed
    assert not isinstance(res["grpc extreme"], GRPCError) and res["grpc extreme"][-1].finish_reason == "length"
    assert res["extreme 5"].json()["usage"]["completion_tokens"] == 20  # min_tokens held every stop id back
    _assert_nothing_left(backend)


def _own_error(r: httpx.Response, status: int, param: str | None) -> bool:
    if r.status_code != status or not r.headers.get("content-type", "").startswith("application/json"):
        return False
    return r.json()["error"]["param"] == param


def _assert_nothing_left(backend: LocalEngineBackend) -> None:
    def idle() -> bool:
        return not backend.run_on_engine(lambda e: e.has_unfinished_requests()).result(timeout=30) \
            and backend.num_requests == 0

    wait_for(idle, timeout_s=30, interval_s=0.05, what="every request ended")

    def used_blocks(e: LLMEngine) -> int:
        e.check_integrity()
        return e.block_manager.num_used_blocks

    assert backend.run_on_engine(used_blocks).result(timeout=30) == 0
    assert backend.last_error is None


def _finished_normally(r: httpx.Response) -> bool:
    if r.status_code != 200:
        return False
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        finishes = [c["choices"][0]["finish_reason"] for c in events if c.get("choices")]
        return not any("error" in c for c in events) and finishes[-1] in ("stop", "length")
    return r.json()["choices"][0]["finish_reason"] in ("stop", "length")


def _disconnect_stream(url: str) -> None:
    """A streaming client that reads one chunk and goes away."""
    body = {"model": MODEL, "prompt": "Count:", "max_tokens": 300, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        next(line for line in r.iter_lines() if line.startswith("data: "))


def _disconnect_waiting(url: str) -> None:
    """A non-streaming client that gives up while its request runs."""
    body = {"model": MODEL, "prompt": "Count:", "max_tokens": 300, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.2))
