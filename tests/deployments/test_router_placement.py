"""Where the router puts a dead decode worker's sequences (`Router._place_moved`), without Ray: the
router's bookkeeping runs on fake workers, and the calls it would make on them are recorded."""

from __future__ import annotations

import asyncio
import types

import pytest

from deployments.cluster import router as router_mod
from deployments.config import ServeConfig
from deployments.cluster.messages import GenRequest
from engine import SamplingParams


class _Calls:
    """A fake actor: `actor.add.remote(req)` records ("add", req)."""

    def __init__(self, log: list):
        self._log = log

    def __getattr__(self, name):
        return types.SimpleNamespace(remote=lambda *a: self._log.append((name, *a)))


def _make_router(monkeypatch, **settings):
    async def no_start(self):
        return None

    monkeypatch.setattr(router_mod.ray, "get_runtime_context",
                        lambda: types.SimpleNamespace(current_actor=None, namespace="test"))
    monkeypatch.setattr(router_mod.Router, "_start", no_start)
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        r = router_mod.Router(ServeConfig.from_dict(dict(num_prefill_workers=1, num_decode_workers=1, **settings)))
        for role in ("prefill", "decode"):
            w = router_mod._Worker(f"{role}-0", role, _Calls([]), info={"num_blocks": 10_000, "max_model_len": 8192},
                                   ready=True)
            r.pools[role][w.worker_id] = w
            r.prefix_index.add_worker(w.worker_id, 10_000)
        yield r
        for task in r._tasks:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*r._tasks, return_exceptions=True))
    finally:
        loop.close()
        asyncio.set_event_loop(None)


@pytest.fixture
def router(monkeypatch):
    yield from _make_router(monkeypatch, prefix_aware_routing=False, enable_prefix_caching=False)


def _tracked(i: int, n: int) -> router_mod._Tracked:
    req = GenRequest(f"r{i}", list(range(1, n + 1)), SamplingParams(max_tokens=8), "hub", None,
                     num_original_prompt_tokens=n - 4, arrival_time=float(i), attempt=1)
    return router_mod._Tracked(req, req.params, "requeueing")


def test_moved_sequences_split_evenly_between_an_idle_prefill_and_an_idle_decode_worker(router, monkeypatch):
    # The decode worker's run of a moved sequence, recorded instead of calling the actor (its
    # bookkeeping is what placement reads: the prompt tokens it has yet to compute).
    ran = []

    def run_whole(t, w, need, cached=0, fetch=None):
        w.reserved_prefill_tokens += len(t.req.prompt_token_ids)
        t.stage, t.worker_id = "admitting", w.worker_id
        ran.append(t.req.request_id)

    monkeypatch.setattr(router, "_run_whole", run_whole)
    moves = router_mod._Moves()
    for i in range(4):
        t = _tracked(i, 200)
        router.tracked[t.req.request_id] = t
        router._place_moved(t, moves)
    to = [m["to"] for m in router.moves]
    # Equal work, both idle: two each, alternating (ties go to the decode worker). Counting the prefill
    # worker's earlier moves twice (its queue and the batch's tally) sent the third to the decode worker.
    assert to == ["decode-0", "prefill-0", "decode-0", "prefill-0"], list(router.moves)
    assert [m["tokens_ahead"] for m in router.moves] == [0, 0, 200, 200]
    assert moves.tokens == {"decode-0": 400, "prefill-0": 400}
    assert ran == ["r0", "r2"]
    assert router.prefill["prefill-0"].queued_prompt_tokens == 400


def test_moved_sequences_queue_behind_the_prefill_step_under_way(router, monkeypatch):
    monkeypatch.setattr(router, "_run_whole", lambda t, w, need, cached=0, fetch=None: setattr(
        w, "reserved_prefill_tokens", w.reserved_prefill_tokens + len(t.req.prompt_token_ids)))
    p = router.prefill["prefill-0"]
    newer = _tracked(99, 700)  # a new prompt (arrived after the moved ones) in the step under way
    router.tracked[newer.req.request_id] = newer
    router._send_to_prefill(newer, p)
    moves = router_mod._Moves()
    for i in range(3):
        t = _tracked(i, 300)
        router.tracked[t.req.request_id] = t
        router._place_moved(t, moves)
    # decode 0 -> 300; prefill 700 + 300 = 1000 vs decode 300 + 300 = 600 -> decode; then decode
    # 600 + 300 = 900 < 1000 -> decode.
    assert [m["to"] for m in router.moves] == ["decode-0", "decode-0", "decode-0"]
    assert [m["tokens_ahead"] for m in router.moves] == [0, 300, 600]


@pytest.fixture
def prefix_router(monkeypatch, request):
    yield from _make_router(monkeypatch, kv_prefix_fetch=request.param)


@pytest.mark.parametrize("prefix_router", [True, False], indirect=True)
def test_moved_sequence_fetches_the_prefix_a_busy_prefill_worker_caches(prefix_router, monkeypatch):
    """The prefill worker that prefilled a sequence still caches its prompt, but is in the middle of a
    700-token step. The survivor pulls the cached prompt and recomputes only the 4 generated tokens
    and the last partial block (`kv_prefix_fetch`); without the fetch it recomputes all 300 tokens,
    which is still sooner than the prefill worker's step plus the tail."""
    router = prefix_router
    ran = []
    monkeypatch.setattr(router, "_run_whole", lambda t, w, need, cached=0, fetch=None: ran.append((cached, fetch)))
    p = router.prefill["prefill-0"]
    busy = _tracked(99, 700)
    router.tracked[busy.req.request_id] = busy
    router._send_to_prefill(busy, p)
    t = _tracked(0, 300)
    router.tracked[t.req.request_id] = t
    router.prefix_index.record("prefill-0", router._hashes(t))  # it prefilled this prompt
    router._place_moved(t, router_mod._Moves())
    move = router.moves[-1]
    assert move["to"] == "decode-0"
    if router.config.kv_prefix_fetch:
        assert ran == [(288, ("prefill-0", p.actor, 288))]  # 18 full blocks, the last token computed
        assert (move["recompute_tokens"], move["fetch_from"]) == (12, "prefill-0")
        assert router.counters["prefix_fetches"] == 1
    else:
        assert ran == [(0, None)] and move["recompute_tokens"] == 300


def test_dead_workers_started_streams_are_placed_before_unstarted_requests(router, monkeypatch):
    """A dead decode worker's streams that have started (clients stalled mid-stream) are placed first,
    longest first; a request still waiting for its first token (a local prefill under way) comes last
    however long it is, and its recompute is not urgent (offset 0)."""
    d = router.decode["decode-0"]
    delivered = {"short": [7] * 10, "unstarted": [], "long": [7] * 5}
    sizes = {"short": 100, "unstarted": 300, "long": 150}
    for i, (rid, n) in enumerate(sizes.items()):
        req = GenRequest(rid, list(range(1, n + 1)), SamplingParams(max_tokens=50), "hub", None,
                         num_original_prompt_tokens=n, arrival_time=float(i))
        router.tracked[rid] = router_mod._Tracked(req, req.params, "decode", worker_id="decode-0")

    async def fake_delivered(req):
        return delivered[req.request_id]

    async def no_replace(role, moved):
        return None

    monkeypatch.setattr(router, "_delivered", fake_delivered)
    monkeypatch.setattr(router, "_replace", no_replace)
    monkeypatch.setattr(router_mod.ray, "kill", lambda actor: None)
    monkeypatch.setattr(router, "_run_whole", lambda t, w, need, cached=0, fetch=None: None)
    spare = router_mod._Worker("decode-1", "decode", _Calls([]), info={"num_blocks": 10_000, "max_model_len": 8192},
                               ready=True)
    router.decode["decode-1"] = spare
    asyncio.get_event_loop().run_until_complete(router._on_worker_dead(d, "killed"))
    assert [m["request_id"] for m in router.moves] == ["long", "short", "unstarted"]
    offsets = {rid: router.tracked[rid].req.offset for rid in sizes}
    assert offsets == {"short": 10, "unstarted": 0, "long": 5}
