"""A bounded soak (loopback only) on both kinds of layout: a mix of good requests, bad ones (400s),
ones whose client closes mid-stream, and ones whose client disconnects while the request is being
submitted, for SOAK_S seconds (at most MAX_REQUESTS), through the HTTP door in this process, over

- `single`: the single-process layout as `pdserve serve --layout single` builds it
  (`build_single_process_app`, served by uvicorn with the server's own HTTP limits);
- `disagg`: a disaggregated Ray router (one prefill, one decode worker, gloo KV transfer).

Both on a tiny random-weight model. Then nothing may be left anywhere:

- KV blocks and requests in every engine (the engines' integrity checks pass, block use back to 0),
  and, on Ray, no abort marks waiting on a decode worker;
- streams in the door's backend (the StreamHub and the router client; the single engine's backend);
- router entries: tracked requests, the pending-decode and unplaced queues;
- KV channels to anything but the live peers.

The figures are printed at the end (`pytest -s`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import random
import time

import httpx
import pytest
import ray

from deployments.config import ServeConfig
from deployments.frontend.http_app import build_openai_app
from deployments.frontend.router_client import RouterBackend
from deployments.frontend.stream_hub import StreamHub
from helpers import ThreadedServer, local_ray, pdserve_router, wait_for, wait_no_leaks

MODEL = "tiny"
SOAK_S = float(os.environ.get("PDSERVE_SOAK_S", "40"))
MAX_REQUESTS = 1500
CONCURRENCY = 6


@pytest.fixture(scope="module", params=["single", "disagg"])
def server(request, tiny_model_dir):
    """(layout name, the door's URL, the layout's handles for the leak checks)."""
    model = tiny_model_dir("llama")
    if request.param == "single":
        with _single_process(model) as (url, backend):
            yield "single", url, backend
        return
    cfg = ServeConfig.from_dict(dict(model=model, num_prefill_workers=1, num_decode_workers=1,
                                     kv_cache_memory_mb=16, max_num_seqs=16))
    with local_ray(2, namespace="pdserve-soak"), pdserve_router(cfg, timeout_s=300) as router:
        from engine.model_loader import load_tokenizer

        info = ray.get(router.wait_ready.remote(60.0), timeout=90)
        hub = StreamHub()
        backend = RouterBackend(router, hub, "hub-soak", request_timeout_s=60)
        app = build_openai_app(backend, load_tokenizer(cfg.engine.model, "float32", None), MODEL,
                               info.max_model_len, vocab_size=info.vocab_size)
        with ThreadedServer(app) as srv:
            yield "disagg", srv.url, (router, hub)


@contextlib.contextmanager
def _single_process(model: str):
    """The single-process layout's app and engine, served with its HTTP limits (local_server.py)."""
    from deployments.http_limits import uvicorn_limits
    from deployments.local_server import build_single_process_app

    cfg = ServeConfig.from_dict(dict(model=model, model_name=MODEL, kv_cache_memory_mb=16, max_num_seqs=16,
                                     num_threads=1, request_timeout_s=60))
    app, backend = build_single_process_app(cfg)
    try:
        with ThreadedServer(app, **uvicorn_limits(cfg)) as srv:
            yield srv.url, backend
    finally:
        backend.shutdown()


def _bad_bodies(vocab: int) -> list[dict]:
    return [dict(prompt="hi", temperature=-1), dict(prompt="hi", max_tokens=0), dict(prompt=[vocab]),
            dict(prompt="hi", top_p=0), dict(prompt="hi", priority=1),
            dict(prompt="hi", unknown_field=1), dict(messages=[]), dict(prompt="hi", stop=["x"] * 99)]


async def _good(client: httpx.AsyncClient, rng: random.Random, stats: collections.Counter) -> None:
    body = dict(model=MODEL, prompt=[rng.randrange(3, 1000) for _ in range(rng.randrange(4, 40))],
                max_tokens=rng.randrange(1, 24), temperature=rng.choice([0, 0.8]), seed=rng.randrange(1000),
                ignore_eos=True, stream=rng.random() < 0.5)
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    if body["stream"]:
        assert r.text.rstrip().endswith("data: [DONE]"), r.text[-200:]
    else:
        assert r.json()["usage"]["completion_tokens"] == body["max_tokens"]
    stats["good"] += 1


async def _bad(client: httpx.AsyncClient, rng: random.Random, stats: collections.Counter, vocab: int) -> None:
    body = rng.choice(_bad_bodies(vocab))
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = await client.post(path, json={"model": MODEL, **body})
    assert r.status_code == 400, (body, r.status_code, r.text)
    assert r.json()["error"]["type"] == "invalid_request_error"
    stats["bad"] += 1


async def _cancelled(client: httpx.AsyncClient, rng: random.Random, stats: collections.Counter) -> None:
    """The client reads a few events of a long stream, then closes the connection."""
    body = dict(model=MODEL, prompt=[rng.randrange(3, 1000) for _ in range(16)], max_tokens=200,
                ignore_eos=True, stream=True)
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        n = 0
        async for line in r.aiter_lines():
            n += line.startswith("data: {")
            if n >= rng.randrange(1, 4):
                break
    stats["cancelled mid-stream"] += 1


async def _disconnected(url: str, rng: random.Random, stats: collections.Counter) -> None:
    """The client goes away while its request is being submitted (before any token)."""
    body = json.dumps(dict(model=MODEL, prompt=[rng.randrange(3, 1000) for _ in range(32)], max_tokens=64,
                           ignore_eos=True)).encode()
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    await writer.drain()
    await asyncio.sleep(rng.choice([0.0, 0.005, 0.02, 0.05]))
    writer.close()
    stats["disconnected during submit"] += 1


async def _soak(url: str, vocab: int) -> collections.Counter:
    stats: collections.Counter = collections.Counter()
    deadline = time.monotonic() + SOAK_S
    sent = 0

    async def client_loop(k: int) -> None:
        nonlocal sent
        rng = random.Random(k)
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            while time.monotonic() < deadline and sent < MAX_REQUESTS:
                sent += 1
                kind = rng.choices(["good", "bad", "cancelled", "disconnected"], [4, 3, 2, 2])[0]
                if kind == "good":
                    await _good(client, rng, stats)
                elif kind == "bad":
                    await _bad(client, rng, stats, vocab)
                elif kind == "cancelled":
                    await _cancelled(client, rng, stats)
                else:
                    await _disconnected(url, rng, stats)

    await asyncio.wait_for(asyncio.gather(*[client_loop(k) for k in range(CONCURRENCY)]), SOAK_S + 120)
    return stats


def _hub_streams(hub) -> dict:
    """What the hub still holds, for the failure message: request id -> (tokens, queued)."""
    return {rid: (len(s.delivered), s.queue.qsize()) for rid, s in list(hub._streams.items())}


def _router_entries(router) -> dict:
    s = ray.get(router.stats.remote(), timeout=30)
    return {k: s[k] for k in ("num_tracked", "num_pending_decode", "num_unplaced")}


def _single_left(backend) -> dict:
    """What the single-process engine and its backend still hold; the engine's integrity check runs
    on its own thread between steps (and raises on a broken block pool)."""
    def probe(eng) -> dict:
        eng.check_integrity()
        return {"blocks": eng.block_manager.num_used_blocks, "engine requests": len(eng._requests),
                "unfinished": int(eng.has_unfinished_requests())}
    return {**backend.run_on_engine(probe).result(timeout=30), "backend streams": backend.num_requests}


@pytest.mark.slow  # per layout: the soak (PDSERVE_SOAK_S, default 40 s) plus ~10 s (single) / ~50 s (Ray's start)
def test_soak_leaves_nothing_behind(server):
    layout, url, handles = server
    if layout == "single":
        vocab = handles.engine.vocab_size
    else:
        vocab = ray.get(handles[0].wait_ready.remote(10.0), timeout=30).vocab_size
    t0 = time.monotonic()
    stats = asyncio.run(_soak(url, vocab))
    soak_s = time.monotonic() - t0
    assert stats["good"] and stats["bad"] and stats["cancelled mid-stream"] and stats["disconnected during submit"]
    if layout == "single":
        _check_single(handles, stats, soak_s)
    else:
        _check_disagg(*handles, stats, soak_s)


def _check_single(backend, stats: collections.Counter, soak_s: float) -> None:
    left = wait_for(lambda: _single_left(backend), lambda d: not any(d.values()), timeout_s=60,
                    what="the engine and its backend hold nothing")
    print(f"\n[soak single] {sum(stats.values())} requests in {soak_s:.0f}s: {dict(stats)}; left behind: {left}; "
          f"engine steps {backend.num_steps}")
    assert backend.last_error is None, backend.last_error  # incl. the idle integrity checks


def _check_disagg(router, hub, stats: collections.Counter, soak_s: float) -> None:
    workers = ray.get(router.workers.remote(), timeout=30)
    use = wait_no_leaks(router, timeout_s=60)  # blocks and requests on every worker; integrity checked
    entries = wait_for(lambda: _router_entries(router), lambda e: not any(e.values()), timeout_s=60,
                       what="router entries gone")
    try:
        streams = wait_for(lambda: hub.num_streams(), lambda n: n == 0, timeout_s=60,
                           what="hub streams gone")
    except AssertionError as e:
        raise AssertionError(f"{e}; left (tokens, queued): {_hub_streams(hub)}") from None
    marks = {w: ray.get(a.num_abort_marks.remote(), timeout=30) for w, a in workers.items() if "decode" in w}
    channels = {w: ray.get(a.kv_channels.remote(), timeout=30) for w, a in workers.items()}
    live = set(workers)
    stray = {w: [p for d in ch.values() for p in d if p not in live] for w, ch in channels.items()}
    counters = ray.get(router.stats.remote(), timeout=30)["counters"]
    print(f"\n[soak disagg] {sum(stats.values())} requests in {soak_s:.0f}s: {dict(stats)}; router counters: "
          f"submitted {counters['submitted']}, finished {counters['finished']}, aborted {counters['aborted']}, "
          f"failed {counters['failed']}, retries {counters['retries']}; left behind: blocks "
          f"{sum(u['num_used_blocks'] for u in use.values())}, worker requests "
          f"{sum(u['num_requests'] for u in use.values())}, router entries {entries}, hub streams {streams}, "
          f"abort marks {marks}, KV channels {channels}; aborted by the workers' client check (an abort that "
          f"never arrived) {sum(u['num_orphans'] for u in use.values())}")
    assert not any(marks.values()), marks
    assert not any(stray.values()), stray
    assert counters["failed"] == 0, counters  # nothing good failed; the bad ones never reached the router
