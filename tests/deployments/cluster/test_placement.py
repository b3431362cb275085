"""`Placement`: where prompts are prefilled, how prefilled sequences are admitted to decode workers,
and what an abort frees, checked on worker views with exact queue lengths, reservations and actions."""

from __future__ import annotations

from conftest import BS, NUM_BLOCKS, Parts, kv_handle

from deployments.cluster.actions import AbortOn, AdmitKV, BackupTarget, ReleaseKV, RunWhole, ToPrefill
from deployments.cluster.messages import DecodeReport, ModelInfo, Role, WorkerInfo
from deployments.cluster.prefix_index import block_hashes
from deployments.cluster.state import Stage, WorkerView, blocks_to_admit


# ---------------------------------------------------------------------------------------------- admission arithmetic
def test_blocks_to_admit_is_the_tokens_blocks_plus_one_of_growth():
    assert [blocks_to_admit(n, 16) for n in (0, 1, 16, 17, 64, 65)] == [1, 2, 2, 3, 5, 6]


def test_a_decode_workers_room_counts_its_report_and_the_admissions_under_way():
    info = WorkerInfo("d0", Role.DECODE, ModelInfo("m", 1024, 1000), 100, BS, "ip", "node")
    w = WorkerView("d0", Role.DECODE, info=info, ready=True)
    assert w.free_capacity(8) == (100, 8)  # no report yet: its whole cache
    w.report = DecodeReport("d0", 30, 100, num_running=5, num_waiting=1, prefill_backlog=40)
    w.reserve(6, prefill_tokens=70)
    assert w.free_capacity(8) == (24, 1) and w.prefill_backlog() == 110
    assert w.has_room(24, 8) and not w.has_room(25, 8)
    w.unreserve(6, taken=True, prefill_tokens=70)  # until its next report, counted as running there
    assert (w.reserved_blocks, w.reserved_seqs, w.reserved_prefill_tokens) == (0, 0, 0)
    pic = w.picture()
    assert (pic.num_free_blocks, pic.num_running, pic.prefill_backlog) == (25, 6, 110)
    w.draining = True
    assert not w.has_room(1, 8)


def test_a_decode_worker_that_has_not_reported_yet_gets_no_more_than_its_slots():
    """A fresh worker (no step, so no report yet) answered a burst's admissions: each taken one counts
    until its first report, so the rest of the burst waits for a slot (it used to be sent them all)."""
    parts = Parts(("p0", "d0"), prefix_aware_routing=False, max_num_seqs=2)
    d0 = parts.w("d0")
    burst = [parts.submit(f"r{i}", 16) for i in range(5)]
    admitted = []
    for t in burst:
        parts.placement.place_prefill(t, allow_local=False)
        for a in parts.placement.prefilled("p0", t.req.request_id, kv_handle("p0", t.req.request_id, 16)):
            assert isinstance(a, AdmitKV) and a.worker is d0
            d0.unreserve(a.need, taken=True)  # its answer: pulled and running there
            a.tracked.stage = Stage.DECODE
            admitted.append(a.tracked.req.request_id)
    assert admitted == ["r0", "r1"] and parts.state.pending_decode == ["r2", "r3", "r4"]
    assert d0.report is None and d0.picture().num_running == 2 and d0.free_capacity(2)[1] == 0
    assert d0.picture().num_free_blocks == NUM_BLOCKS - 2 * (blocks_to_admit(16, BS) - 1)
    # Its first report, one sequence finished: one slot, filled from the queue.
    report = parts.report("d0", free=NUM_BLOCKS - 2, running=1, finished=("r0",))
    assert [a.tracked.req.request_id for a in parts.placement.reported(report)] == ["r2"]



def test_a_report_taken_before_an_admission_but_heard_after_its_answer_still_counts_it():
    """Reports are numbered, and an admission's answer says how many the worker had taken: a report
    older than the admission (sent before it, heard after its answer) leaves it counted; the first
    report taken after it replaces the count; a report heard after a newer one is not counted at all
    (its finished sequences are)."""
    parts = Parts(("p0", "d0"), prefix_aware_routing=False, max_num_seqs=2)
    d0 = parts.w("d0")

    def report(seq: int, running: int, finished: tuple[str, ...] = ()) -> DecodeReport:
        r = parts.report("d0", free=NUM_BLOCKS - 2 * running, running=running, finished=finished)
        r.seq = seq
        return r

    assert parts.placement.reported(report(1, 0)) == []
    burst = [parts.submit(f"r{i}", 16) for i in range(3)]
    for t in burst:
        parts.placement.place_prefill(t, allow_local=False)
    admits = [a for t in burst for a in parts.placement.prefilled("p0", t.req.request_id,
                                                                   kv_handle("p0", t.req.request_id, 16))]
    assert [a.tracked.req.request_id for a in admits] == ["r0", "r1"] and parts.state.pending_decode == ["r2"]
    for a in admits:  # taken after the worker's report 2 (not sent yet): reports from 3 on count them
        d0.unreserve(a.need, taken=True, report_seq=2)
        a.tracked.stage = Stage.DECODE
    assert parts.placement.reported(report(2, 0)) == []  # older than both: they still hold the slots
    assert d0.free_capacity(2)[1] == 0 and d0.picture().num_running == 2
    assert parts.placement.reported(report(3, 2)) == []  # counts them itself now: still full, not 4
    assert d0.taken == [] and d0.free_capacity(2)[1] == 0
    # Report 5 (r0 finished) is heard before report 4: the slot is filled, and report 4, heard late, is
    # not counted (it would have freed r0's slot a second time); its finished ids would still be.
    [a] = parts.placement.reported(report(5, 1, finished=("r0",)))
    assert a.tracked.req.request_id == "r2"
    d0.unreserve(a.need, taken=True, report_seq=5)
    assert parts.placement.reported(report(4, 0)) == []
    assert d0.report.seq == 5 and d0.free_capacity(2)[1] == 0


# ---------------------------------------------------------------------------------------------- prefill
def test_a_prompt_goes_to_the_least_queued_prefill_worker():
    parts = Parts(("p0", "p1", "d0"), prefix_aware_routing=False)
    parts.w("p0").queued_prompt_tokens = 100
    t = parts.submit("r", 64)
    assert parts.placement.place_prefill(t) == [ToPrefill(t, "p1")]
    assert (t.stage, t.worker_id, t.prefill_worker_id, t.queued_tokens) == (Stage.PREFILL, "p1", "p1", 64)
    assert (parts.w("p0").queued_prompt_tokens, parts.w("p1").queued_prompt_tokens) == (100, 64)
    parts.placement.prefill_done(t)
    assert parts.w("p1").queued_prompt_tokens == 0 and t.queued_tokens == 0


def test_a_prompt_goes_where_its_prefix_is_cached_when_that_is_sooner():
    parts = Parts(("p0", "p1", "d0"))
    parts.state.prefix_index.record("p1", block_hashes(list(range(1, 49)), BS))  # 3 blocks of its prefix
    parts.w("p1").queued_prompt_tokens = 20
    t = parts.submit("r", 64)
    # p0: 0 queued + 64 to compute; p1: 20 queued + 64 - 48 cached
    assert parts.placement.place_prefill(t) == [ToPrefill(t, "p1")]
    assert t.queued_tokens == 16 and parts.w("p1").queued_prompt_tokens == 36
    c = parts.state.counters
    assert (c.prefix_routed, c.prefix_routed_tokens) == (1, 48)
    assert parts.state.prefix_index.num_blocks("p1") == 4  # the whole prompt is cached there now
    other = parts.submit("other", 64, first=500)
    assert parts.placement.place_prefill(other) == [ToPrefill(other, "p0")]  # nothing cached: load wins


def test_a_short_prompt_runs_on_an_idle_decode_worker_when_the_prefill_pool_is_backed_up():
    parts = Parts(prefix_aware_routing=False)
    parts.w("p0").queued_prompt_tokens = 1000
    t = parts.submit("short", 100)
    d0 = parts.w("d0")
    # decode: 2 x 100 < prefill: 1000 + 100
    assert parts.placement.place_prefill(t) == [RunWhole(t, d0, need=8, own=100)]
    assert (t.stage, t.worker_id, t.prefill_worker_id) == (Stage.ADMITTING, "d0", None)
    assert (d0.reserved_blocks, d0.reserved_seqs, d0.reserved_prefill_tokens) == (8, 1, 100)
    assert (parts.state.counters.local_prefills, parts.state.counters.admitted) == (1, 1)
    long = parts.submit("long", 600)  # over local_prefill_max_tokens
    assert parts.placement.place_prefill(long) == [ToPrefill(long, "p0")]
    busy = parts.submit("busy", 100)  # d0 now has 100 to compute first: 2 x 200 < 1600 still
    assert isinstance(parts.placement.place_prefill(busy)[0], RunWhole)
    d0.report = parts.report("d0", free=80, backlog=600)  # 2 x (600 + 200 + 100) >= 1600 + 100
    late = parts.submit("late", 100)
    assert parts.placement.place_prefill(late) == [ToPrefill(late, "p0")]
    again = parts.submit("again", 100)
    assert parts.placement.place_prefill(again, allow_local=False) == [ToPrefill(again, "p0")]


def test_without_a_ready_prefill_worker_a_prompt_waits_and_is_placed_when_one_joins(parts):
    parts.w("p0").ready = False
    t = parts.submit("r", 32)
    assert parts.placement.place_prefill(t) == [] and parts.placement.place_prefill(t) == []
    assert t.stage is Stage.UNPLACED and parts.state.unplaced == ["r"]
    parts.w("p0").ready = True
    assert parts.placement.flush_unplaced() == [ToPrefill(t, "p0")]
    assert parts.state.unplaced == []


# ---------------------------------------------------------------------------------------------- decode admission
def test_prefilled_sequences_go_to_the_decode_worker_with_the_most_free_blocks():
    parts = Parts(("p0", "d0", "d1"), prefix_aware_routing=False)
    d0, d1 = parts.w("d0"), parts.w("d1")
    assert parts.placement.reported(parts.report("d0", free=10)) == []
    assert parts.placement.reported(parts.report("d1", free=50)) == []
    t = parts.submit("r1", 64)
    parts.placement.place_prefill(t)
    assert parts.placement.prefilled("p0", "r1", kv_handle("p0", "r1", 64)) == [AdmitKV(t, d1, "p0", 5)]
    assert (t.stage, t.worker_id, t.prefill_worker_id) == (Stage.ADMITTING, "d1", "p0")
    assert parts.w("p0").queued_prompt_tokens == 0 and parts.state.pending_decode == []
    assert (d1.reserved_blocks, d1.reserved_seqs, parts.state.counters.admitted) == (5, 1, 1)
    d1.unreserve(5, taken=True)
    assert (d1.reserved_blocks, d1.picture().num_free_blocks, d1.picture().num_running) == (0, 46, 1)
    assert d0.reserved_blocks == 0


def test_pending_sequences_wait_for_room_then_go_by_priority_and_arrival():
    parts = Parts(("p0", "d0"), prefix_aware_routing=False)
    parts.placement.reported(parts.report("d0", free=3))
    late = parts.submit("late", 64, priority=0, arrival=5.0)
    urgent = parts.submit("urgent", 64, priority=0, arrival=1.0)
    low = parts.submit("low", 64, priority=1, arrival=0.0)
    for t in (late, urgent, low):
        parts.placement.place_prefill(t, allow_local=False)
        assert parts.placement.prefilled("p0", t.req.request_id, kv_handle("p0", t.req.request_id, 64)) == []
    assert parts.state.pending_decode == ["urgent", "late", "low"]  # kept sorted: priority, then arrival
    # Room for two (5 blocks each): the earlier arrival of priority 0 first, then the other; "low" waits.
    d0 = parts.w("d0")
    assert parts.placement.reported(parts.report("d0", free=12)) == [AdmitKV(urgent, d0, "p0", 5),
                                                                      AdmitKV(late, d0, "p0", 5)]
    assert parts.state.pending_decode == ["low"] and low.stage is Stage.PENDING_DECODE
    for t in (urgent, late):  # both pulled their KV: the next report counts them
        d0.unreserve(5, taken=True)
        t.stage = Stage.DECODE
    assert d0.free_capacity(64) == (12 - 2 * 4, 62)
    report = parts.report("d0", free=7, running=1, finished=("urgent",))
    assert parts.placement.reported(report) == [AdmitKV(low, d0, "p0", 5)]
    assert "urgent" not in parts.state.tracked and parts.state.counters.finished == 1
    assert (d0.num_steps, d0.max_batch_seen) == (3, 0)


def test_colocated_whole_requests_go_where_their_prefix_is_cached_unless_that_worker_is_much_busier():
    parts = Parts(("d0", "d1"), num_prefill_workers=0)
    d0, d1 = parts.w("d0"), parts.w("d1")
    prompt = list(range(1, 65))
    parts.state.prefix_index.record("d0", block_hashes(prompt, BS))
    for running, want, cached in ((3, d0, 48), (5, d1, 0)):  # AFFINITY_SLACK_SEQS = 4
        d0.report, d1.report = parts.report("d0", free=50, running=running), parts.report("d1", free=60)
        t = parts.submit(f"r{running}", 64)
        assert parts.placement.place_prefill(t) == [RunWhole(t, want, need=5, own=64 - cached)]
        want.unreserve(5, taken=False, prefill_tokens=64 - cached)
    fresh = parts.submit("fresh", 64, first=900)  # nothing cached anywhere: the most free blocks
    assert parts.placement.place_prefill(fresh) == [RunWhole(fresh, d1, need=5, own=64)]


def test_a_local_prefill_is_backed_up_on_the_prefill_worker_caching_most_of_it():
    parts = Parts(("p0", "p1", "d0"))
    prompt = list(range(1, 101))  # 6 full blocks
    parts.state.prefix_index.record("p0", block_hashes(prompt[:32], BS))
    parts.w("p0").queued_prompt_tokens, parts.w("p1").queued_prompt_tokens = 700, 600
    t = parts.submit("r", 100)
    assert parts.placement.backup_target(t) == BackupTarget("p0", 2)
    [run] = parts.placement.place_prefill(t)  # 2 x 100 < 600 + 100: local
    assert run == RunWhole(t, parts.w("d0"), need=8, own=100, backup=BackupTarget("p0", 2))
    parts.state.prefix_index.record("p1", block_hashes(prompt, BS))  # p1 has all of it
    assert parts.placement.backup_target(t) is None


# ---------------------------------------------------------------------------------------------- aborts
def test_an_abort_frees_what_its_stage_holds(parts):
    on_prefill = parts.submit("a", 64)
    parts.placement.place_prefill(on_prefill, allow_local=False)
    assert parts.placement.abort("a") == [AbortOn("p0", "a", 0, True)]  # names its attempt; its add may be on its way
    assert parts.w("p0").queued_prompt_tokens == 0 and "a" not in parts.state.tracked
    leased = parts.submit("b", 64)
    parts.placement.place_prefill(leased, allow_local=False)
    parts.w("d0").ready = False  # no decode room: it stays leased on p0
    parts.placement.prefilled("p0", "b", kv_handle("p0", "b", 64, epoch=7))
    assert parts.placement.abort("b") == [ReleaseKV("p0", "b", 7)]
    decoding = parts.submit("c", 64)
    decoding.stage, decoding.worker_id = Stage.DECODE, "d0"
    assert parts.placement.abort("c") == [AbortOn("d0", "c", 0)]
    assert parts.placement.abort("c") == [] and parts.state.counters.aborted == 3
    # its KV arrives after the abort: released at once
    assert parts.placement.prefilled("p0", "a", kv_handle("p0", "a", 64, epoch=2)) == [ReleaseKV("p0", "a", 2)]
    assert parts.placement.prefilled("p9", "a", kv_handle("p9", "a", 64)) == []  # from a worker gone since


def test_a_finished_prefill_leaves_its_workers_queue(parts):
    t = parts.submit("r", 64)
    parts.placement.place_prefill(t, allow_local=False)
    parts.placement.finished("p1", "r")  # not where it runs: ignored
    assert "r" in parts.state.tracked
    parts.placement.finished("p0", "r")
    assert "r" not in parts.state.tracked and parts.w("p0").queued_prompt_tokens == 0
    assert parts.state.counters.finished == 1


def test_an_abort_of_an_untracked_request_is_kept_a_while_for_its_submit(monkeypatch):
    """An abort heard before its submit (Ray may reorder one caller's calls to the router) leaves the
    id for the submit to find; ids go after `ttl_s`, and at most `max_size` are kept."""
    parts = Parts()
    assert parts.placement.abort("early") == []
    assert parts.state.early_aborts.take("early") and not parts.state.early_aborts.take("early")
    t = parts.submit("tracked", 16)
    parts.placement.place_prefill(t)
    parts.placement.abort("tracked")
    assert not parts.state.early_aborts.take("tracked")  # it was tracked: its abort did the work

    from deployments.cluster.state import ExpiringSet
    now = [1000.0]
    monkeypatch.setattr("deployments.cluster.state.time.monotonic", lambda: now[0])
    marks = ExpiringSet(ttl_s=60.0, max_size=3)
    for rid in "abcd":
        marks.add(rid)
    assert len(marks) == 3 and not marks.take("a")  # the oldest went
    now[0] += 61.0
    marks.add("e")
    assert len(marks) == 1 and marks.take("e")
