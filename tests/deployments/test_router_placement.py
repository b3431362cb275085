"""Where a dead decode worker's sequences go (`Placement.place_moved`, `Recovery.relocate`), without
Ray: the router's plain parts run on worker views, and the actions they return (the Ray calls the
router actor would make) are checked instead of made."""

from __future__ import annotations

import pytest

from deployments.cluster.actions import PrefixFetch, RunWhole, ToPrefill
from deployments.cluster.messages import GenRequest, ModelInfo, Role, WorkerInfo
from deployments.cluster.placement import Moves, Placement
from deployments.cluster.prefix_index import PrefixIndex
from deployments.cluster.recovery import Recovery
from deployments.cluster.state import RouterState, Stage, Tracked, WorkerView
from deployments.config import ServeConfig
from engine import SamplingParams


class Parts:
    """A router's state and plain parts, with one ready prefill worker and one ready decode worker."""

    def __init__(self, **settings):
        self.config = ServeConfig.from_dict(dict(num_prefill_workers=1, num_decode_workers=1, **settings))
        self.state = RouterState(PrefixIndex(self.config.engine.block_size))
        self.placement = Placement(self.config, self.state)
        self.recovery = Recovery(self.config, self.state, self.placement)
        for role in Role:
            self.add_worker(f"{role.value}-0", role)

    def add_worker(self, worker_id: str, role: Role) -> WorkerView:
        info = WorkerInfo(worker_id, role, ModelInfo("model", 8192, 1000), 10_000, 16, "127.0.0.1", "node")
        w = self.state.pools[role][worker_id] = WorkerView(worker_id, role, info=info, ready=True)
        self.state.prefix_index.add_worker(worker_id, 10_000)
        return w

    def track(self, t: Tracked) -> Tracked:
        self.state.tracked[t.req.request_id] = t
        return t


@pytest.fixture
def parts():
    return Parts(prefix_aware_routing=False, enable_prefix_caching=False)


def _tracked(i: int, n: int) -> Tracked:
    req = GenRequest(f"r{i}", list(range(1, n + 1)), SamplingParams(max_tokens=8), "hub", None,
                     num_original_prompt_tokens=n - 4, arrival_time=float(i), attempt=1)
    return Tracked(req, req.params, Stage.REQUEUEING)


def test_moved_sequences_split_evenly_between_an_idle_prefill_and_an_idle_decode_worker(parts):
    moves = Moves()
    actions = [a for i in range(4) for a in parts.placement.place_moved(parts.track(_tracked(i, 200)), moves)]
    to = [m.to for m in parts.state.moves]
    # Equal work, both idle: two each, alternating (ties go to the decode worker). Counting the prefill
    # worker's earlier moves twice (its queue and the batch's tally) sent the third to the decode worker.
    assert to == ["decode-0", "prefill-0", "decode-0", "prefill-0"], list(parts.state.moves)
    assert [m.tokens_ahead for m in parts.state.moves] == [0, 0, 200, 200]
    assert moves.tokens == {"decode-0": 400, "prefill-0": 400}
    assert [(type(a), a.tracked.req.request_id) for a in actions] == [
        (RunWhole, "r0"), (ToPrefill, "r1"), (RunWhole, "r2"), (ToPrefill, "r3")]
    assert parts.state.prefill["prefill-0"].queued_prompt_tokens == 400
    d = parts.state.decode["decode-0"]  # both runs reserved until the worker answers: 13 + 1 blocks each
    assert (d.reserved_prefill_tokens, d.reserved_seqs, d.reserved_blocks) == (400, 2, 28)


def test_moved_sequences_queue_behind_the_prefill_step_under_way(parts):
    p = parts.state.prefill["prefill-0"]
    newer = parts.track(_tracked(99, 700))  # a new prompt (arrived after the moved ones) in the step under way
    parts.placement.send_to_prefill(newer, p)
    moves = Moves()
    for i in range(3):
        parts.placement.place_moved(parts.track(_tracked(i, 300)), moves)
    # decode 0 -> 300; prefill 700 + 300 = 1000 vs decode 300 + 300 = 600 -> decode; then decode
    # 600 + 300 = 900 < 1000 -> decode.
    assert [m.to for m in parts.state.moves] == ["decode-0", "decode-0", "decode-0"]
    assert [m.tokens_ahead for m in parts.state.moves] == [0, 300, 600]


@pytest.mark.parametrize("fetch", [True, False])
def test_moved_sequence_fetches_the_prefix_a_busy_prefill_worker_caches(fetch):
    """The prefill worker that prefilled a sequence still caches its prompt, but is in the middle of a
    700-token step. The survivor pulls the cached prompt and recomputes only the 4 generated tokens
    and the last partial block (`kv_prefix_fetch`); without the fetch it recomputes all 300 tokens,
    which is still sooner than the prefill worker's step plus the tail."""
    parts = Parts(kv_prefix_fetch=fetch)
    p = parts.state.prefill["prefill-0"]
    busy = parts.track(_tracked(99, 700))
    parts.placement.send_to_prefill(busy, p)
    t = parts.track(_tracked(0, 300))
    parts.state.prefix_index.record("prefill-0", parts.placement.hashes(t))  # it prefilled this prompt
    [run] = parts.placement.place_moved(t, Moves())
    move = parts.state.moves[-1]
    assert move.to == "decode-0" and isinstance(run, RunWhole)
    if fetch:
        assert (run.own, run.fetch) == (12, PrefixFetch("prefill-0", 288))  # 18 full blocks, the last token computed
        assert (move.recompute_tokens, move.fetch_from) == (12, "prefill-0")
        assert parts.state.counters.prefix_fetches == 1
    else:
        assert (run.own, run.fetch) == (300, None) and move.recompute_tokens == 300


def test_dead_workers_started_streams_are_placed_before_unstarted_requests(parts):
    """A dead decode worker's streams that have started (clients stalled mid-stream) are placed first,
    longest first; a request still waiting for its first token (a local prefill under way) comes last
    however long it is, and its recompute is not urgent (offset 0)."""
    d = parts.state.decode["decode-0"]
    delivered = {"short": [7] * 10, "unstarted": [], "long": [7] * 5}
    sizes = {"short": 100, "unstarted": 300, "long": 150}
    for i, (rid, n) in enumerate(sizes.items()):
        req = GenRequest(rid, list(range(1, n + 1)), SamplingParams(max_tokens=50), "hub", None,
                         num_original_prompt_tokens=n, arrival_time=float(i))
        parts.track(Tracked(req, req.params, Stage.DECODE, worker_id="decode-0"))
    parts.add_worker("decode-1", Role.DECODE)
    assert parts.state.remove_worker(d)
    lost = parts.recovery.lost_on(d)
    parts.recovery.relocate(lost, [delivered[t.req.request_id] for t, _ in lost], "decode-0 died")
    assert [m.request_id for m in parts.state.moves] == ["long", "short", "unstarted"]
    offsets = {rid: parts.state.tracked[rid].req.offset for rid in sizes}
    assert offsets == {"short": 10, "unstarted": 0, "long": 5}
