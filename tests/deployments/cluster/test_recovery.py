"""`Recovery`: a restarted router's state rebuilt from the workers' snapshots, a dead worker's
requests found and placed again from the tokens their clients have, attempts bounded, and the wait
for moved sequences to settle before a replacement starts."""

from __future__ import annotations

from conftest import Parts, kv_handle, request

from deployments.cluster.actions import AdmitKV, EndStream, RunWhole, ToPrefill
from deployments.cluster.messages import LeasedKV, StreamEvent, WorkerSnapshot
from deployments.cluster.recovery import MAX_ATTEMPTS, Claim, Lost, MovedSettling, Requeue
from deployments.cluster.state import Stage
from engine import SamplingParams


def test_a_restarted_router_tracks_what_the_adopted_workers_hold():
    parts = Parts(prefix_aware_routing=False)
    a, b, c = request("a", 20), request("b", 40), request("c", 32)
    snapshots = {"d0": WorkerSnapshot(decoding=[a]),
                 "p0": WorkerSnapshot(prefilling=[b], leased=[LeasedKV(c, kv_handle("p0", "c", 32)),
                                                              LeasedKV(a, kv_handle("p0", "a", 20))])}
    actions = parts.recovery.rebuild(snapshots)
    tracked = parts.state.tracked
    assert actions == [AdmitKV(tracked["c"], parts.w("d0"), "p0", 3)]  # the leased one goes to decode
    assert (tracked["a"].stage, tracked["a"].worker_id) == (Stage.DECODE, "d0")  # decoding wins over its lease
    assert (tracked["b"].stage, tracked["b"].worker_id, tracked["b"].queued_tokens) == (Stage.PREFILL, "p0", 40)
    assert (tracked["c"].stage, tracked["c"].worker_id) == (Stage.ADMITTING, "d0")
    assert parts.w("p0").queued_prompt_tokens == 40
    assert (parts.state.counters.adopted_requests, parts.state.counters.admitted) == (3, 1)


def test_a_dead_worker_loses_only_what_it_holds():
    parts = Parts(prefix_aware_routing=False)
    prefilling, leased, decoding = parts.submit("a", 10), parts.submit("b", 10), parts.submit("c", 10)
    prefilling.stage, prefilling.worker_id, prefilling.prefill_worker_id = Stage.PREFILL, "p0", "p0"
    leased.stage, leased.prefill_worker_id = Stage.PENDING_DECODE, "p0"
    decoding.stage, decoding.worker_id, decoding.prefill_worker_id = Stage.DECODE, "d0", "p0"
    assert parts.recovery.lost_on(parts.w("p0")) == [Lost(prefilling, Requeue.RETRY), Lost(leased, Requeue.RETRY)]
    assert parts.recovery.lost_on(parts.w("d0")) == [Lost(decoding, Requeue.MIGRATION)]


def test_requeueing_is_claimed_once_and_gives_up_after_max_attempts():
    parts = Parts(prefix_aware_routing=False)
    t = parts.submit("r", 10)
    t.req.attempt = MAX_ATTEMPTS - 2
    assert parts.recovery.claim(t) is Claim.GO and t.stage is Stage.REQUEUEING
    assert parts.recovery.claim(t) is Claim.ALREADY
    last = parts.submit("last", 10)
    last.req.attempt, last.req.offset = MAX_ATTEMPTS - 1, 3
    assert parts.recovery.claim(last) is Claim.EXHAUSTED
    assert parts.recovery.give_up(last, "p0 died") == EndStream(last.req, StreamEvent(
        "last", 3, [], True, "error", f"gave up after {MAX_ATTEMPTS} attempts: p0 died"))
    assert "last" not in parts.state.tracked and parts.state.counters.failed == 1


def test_a_retry_prefills_the_original_prompt_plus_every_token_the_client_has():
    parts = Parts(("p0", "p1", "d0"), prefix_aware_routing=False)
    t = parts.submit("r", 40)
    t.params = SamplingParams(max_tokens=20, min_tokens=5)
    # an earlier move already appended 2 tokens; the client has 4 now
    t.req.prompt_token_ids += [901, 902]
    t.req.offset, t.req.attempt = 2, 1
    assert parts.state.remove_worker(parts.w("p0"))
    assert parts.recovery.claim(t) is Claim.GO
    actions = parts.recovery.requeue(t, Requeue.RETRY, [901, 902, 903, 904])
    assert actions == [ToPrefill(t, "p1")]  # not prefilled locally, though the decode worker is idle
    assert t.req.prompt_token_ids == list(range(1, 41)) + [901, 902, 903, 904]
    assert (t.req.offset, t.req.attempt, t.req.params.max_tokens, t.req.params.min_tokens) == (4, 2, 16, 1)
    assert t.params.max_tokens == 20  # the client's ask, for the next move
    assert (t.stage, t.handle, parts.state.counters.retries) == (Stage.PREFILL, None, 1)


def test_a_requeue_ends_the_stream_when_nothing_is_left_to_generate_or_the_client_is_gone():
    parts = Parts(prefix_aware_routing=False)
    done = parts.submit("done", 40)
    parts.recovery.claim(done)
    assert parts.recovery.requeue(done, Requeue.MIGRATION, [7] * 20) == [
        EndStream(done.req, StreamEvent("done", 20, [], True, "length", num_prompt_tokens=40))]
    full = parts.submit("full", 1010)  # max_model_len 1024
    parts.recovery.claim(full)
    assert parts.recovery.requeue(full, Requeue.MIGRATION, [7] * 14) == [
        EndStream(full.req, StreamEvent("full", 14, [], True, "length", num_prompt_tokens=1010))]
    orphan = parts.submit("orphan", 40)
    parts.recovery.claim(orphan)
    assert parts.recovery.requeue(orphan, Requeue.MIGRATION, None) == []  # its ingress replica is gone
    assert parts.state.tracked == {} and parts.state.counters.migrations == 2


def test_a_dead_decode_workers_sequences_move_to_a_survivor_except_those_out_of_attempts():
    parts = Parts(("p0", "d0", "d1"), prefix_aware_routing=False)
    parts.w("p0").queued_prompt_tokens = 5000  # the prefill pool is far behind: survivors recompute
    moved, spent = parts.submit("moved", 30), parts.submit("spent", 30)
    spent.req.attempt = MAX_ATTEMPTS - 1
    for t in (moved, spent):
        t.stage, t.worker_id = Stage.DECODE, "d0"
    d0 = parts.w("d0")
    assert parts.state.remove_worker(d0)
    lost = parts.recovery.lost_on(d0)
    actions, moving = parts.recovery.relocate(lost, [[5, 6], [5]], "d0 died")
    assert actions == [RunWhole(moved, parts.w("d1"), need=3, own=32),
                       EndStream(spent.req, StreamEvent("spent", 0, [], True, "error",
                                                        f"gave up after {MAX_ATTEMPTS} attempts: d0 died"))]
    assert moving.tokens == {"d1": 32} and moving.ids == {"moved"}
    assert (moved.req.offset, moved.req.attempt) == (2, 1)


def test_a_replacement_waits_until_each_moved_sequence_ran_a_whole_step_on_its_new_worker():
    parts = Parts(("d0", "d1"), num_prefill_workers=0, prefix_aware_routing=False)
    a, gone = parts.submit("a", 10), parts.submit("gone", 10)
    a.stage, a.worker_id = Stage.ADMITTING, "d1"
    settling = MovedSettling(parts.state, [a, gone])
    del parts.state.tracked["gone"]  # finished meanwhile: nothing to wait for
    assert settling.waiting()
    d1 = parts.w("d1")
    d1.num_steps, a.stage = 10, Stage.DECODE
    assert settling.waiting()  # joined during step 10
    d1.num_steps = 11
    assert settling.waiting()  # step 11 may have started before it joined
    d1.num_steps = 12
    assert not settling.waiting()
