"""The role controller and the switch's bookkeeping (deployments/cluster/roles.py) on worker views,
without Ray, on a simulated clock: steady loads never switch (held for a minute), a shift does within
seconds, one switch at a time, never the last worker of a pool, and the router's placement keeps
working for what a switched worker still holds."""

from __future__ import annotations

import pytest

from conftest import Parts, kv_handle
from deployments.cluster.actions import AdmitKV, ReleaseKV
from deployments.cluster.messages import Role
from deployments.cluster.roles import RoleController
from deployments.cluster.state import Stage
from deployments.config import ServeConfigError

TARGET = 100  # prefill_target_queued_tokens in these tests


def _parts(workers=("p0", "d0", "d1"), **settings) -> tuple[Parts, RoleController]:
    settings = {"role_switching": True, "prefill_target_queued_tokens": TARGET, "prefix_aware_routing": False,
                "role_switch_hold_s": 3.0, "role_switch_dwell_s": 15.0, **settings}
    p = Parts(workers, **settings)
    return p, RoleController(p.config, p.state)


def _queue(p: Parts, worker_id: str, tokens: int) -> None:
    p.w(worker_id).queued_prompt_tokens = tokens


def _run(ctl: RoleController, start: float, seconds: float, step: float = 0.5, each=None):
    """Tick every `step` seconds from `start` for `seconds`; the first plan returned and its time."""
    now = start
    while now <= start + seconds:
        if each is not None:
            each(now)
        plan = ctl.tick(now)
        if plan is not None:
            return plan, now
        now += step
    return None, now


def test_a_steady_load_within_targets_never_switches_in_a_minute():
    p, ctl = _parts()
    _queue(p, "p0", 60)
    for d in ("d0", "d1"):
        p.w(d).report = p.report(d, free=60, running=3)
    plan, _ = _run(ctl, 1000.0, 60.0)
    assert plan is None
    assert ctl.last_pressure.prefill < 1 and ctl.last_pressure.decode < 1


def test_a_steady_load_over_both_sides_targets_never_switches():
    """Neither side can spare a worker: switching cannot help (autoscaling's job)."""
    p, ctl = _parts()
    _queue(p, "p0", 5 * TARGET)
    p.state.pending_decode[:] = [f"x{i}" for i in range(40)]  # 40 waiting for a slot, 4/worker target
    plan, _ = _run(ctl, 1000.0, 60.0)
    assert plan is None
    assert ctl.hold() == frozenset()


def test_a_load_flickering_across_the_target_does_not_switch():
    p, ctl = _parts()
    flip = {"n": 0}

    def each(now):  # over the target one tick, under it the next
        flip["n"] += 1
        _queue(p, "p0", 3 * TARGET if flip["n"] % 2 else TARGET // 2)

    plan, _ = _run(ctl, 1000.0, 60.0, each=each)
    assert plan is None


def test_a_shift_to_long_prompts_switches_the_least_loaded_decode_worker_within_seconds():
    p, ctl = _parts()
    p.w("d0").report = p.report("d0", free=90, running=2)
    p.w("d1").report = p.report("d1", free=95, running=0)
    p.submit("busy", 10)
    p.state.tracked["busy"].stage, p.state.tracked["busy"].worker_id = Stage.DECODE, "d0"
    _queue(p, "p0", 40)
    assert _run(ctl, 1000.0, 10.0)[0] is None
    _queue(p, "p0", 6 * TARGET)  # the shift
    plan, when = _run(ctl, 1010.0, 10.0)
    assert plan is not None
    w, role, reason = plan
    assert (w.worker_id, role) == ("d1", Role.PREFILL)
    assert 3.0 <= when - 1010.0 <= 4.0, when  # role_switch_hold_s, then the next tick
    assert "queued prompt tokens" in reason
    assert ctl.hold() == frozenset({Role.PREFILL})  # autoscaling waits for the switch


def test_one_switch_at_a_time_then_the_dwell():
    p, ctl = _parts(workers=("p0", "p1", "d0", "d1", "d2"))
    _queue(p, "p0", 8 * TARGET)
    plan, when = _run(ctl, 0.0, 10.0)
    w, role, reason = plan
    ctl.begin(w, role, reason, when)
    assert w.leaving and not w.takes_work and w.switching_to is Role.PREFILL
    assert p.state.counters.role_switches == 1
    assert _run(ctl, when, 30.0)[0] is None  # still switching: no second one
    ctl.complete(w, when + 1)
    assert w.role is Role.PREFILL and w.worker_id in p.state.prefill and w.worker_id not in p.state.decode
    assert ctl.decisions[-1].completed_at == when + 1
    _queue(p, "p0", 20 * TARGET)  # still over: a second switch, but only after the dwell
    plan2, when2 = _run(ctl, when + 1, 60.0)
    assert plan2 is not None and when2 - (when + 1) >= p.config.role_switch_dwell_s


def test_the_last_worker_of_a_pool_never_switches():
    p, ctl = _parts(workers=("p0", "d0"))
    _queue(p, "p0", 50 * TARGET)
    assert _run(ctl, 0.0, 60.0)[0] is None


def test_decode_pressure_takes_a_prefill_worker():
    p, ctl = _parts(workers=("p0", "p1", "d0"))
    p.w("d0").report = p.report("d0", free=5, running=8)  # KV 95% used, target 85%
    plan, _ = _run(ctl, 0.0, 10.0)
    assert plan is not None and plan[1] is Role.DECODE and plan[0].role is Role.PREFILL


def test_ttft_and_tpot_targets_count():
    p, ctl = _parts(workers=("p0", "d0", "d1"), ttft_target_ms=200.0, tpot_target_ms=100.0)
    for i in range(20):
        p.state.latencies.record_ttft(0.5, now=100.0 + i * 0.1)  # 500 ms against 200
    pr = ctl.pressure(102.0)
    assert pr.prefill == pytest.approx(2.5) and "TTFT p90 500 ms" in pr.prefill_why
    for i in range(20):
        p.state.latencies.record_step(0.3, now=100.0 + i * 0.1)
    assert ctl.pressure(102.0).decode == pytest.approx(3.0)
    assert ctl.pressure(200.0).prefill == 0.0  # the window moved on


def test_old_role_work_and_what_a_switched_prefill_worker_still_holds():
    """p1 leaves the prefill role with a prompt still computing and one prefilled (KV leased on it):
    the switch waits for the first; the lease is admitted to another decode worker, never to p1."""
    p, ctl = _parts(workers=("p0", "p1", "d0"))
    for rid in ("a", "b"):
        t = p.submit(rid, 32)
        p.placement.send_to_prefill(t, p.w("p1"))
    p.placement.prefilled("p1", "b", kv_handle("p1", "b", 32))  # waits for a slot (d0 has no report yet? it has)
    ctl.begin(p.w("p1"), Role.DECODE, "test", 0.0)
    assert ctl.old_role_work(p.w("p1")) == 1
    p.placement.finished("p1", "a")
    assert ctl.old_role_work(p.w("p1")) == 0
    ctl.complete(p.w("p1"), 1.0)
    assert "p1" in p.state.decode
    p.state.tracked["b"].stage, p.state.tracked["b"].worker_id = Stage.PENDING_DECODE, None
    p.state.pending_decode[:] = ["b"]
    p.w("d0").report = p.report("d0", free=0)  # no room on d0; p1 has room but holds the lease itself
    assert p.placement.admit() == []
    p.w("d0").report = p.report("d0", free=50)
    [a] = p.placement.admit()
    assert isinstance(a, AdmitKV) and a.worker.worker_id == "d0" and a.prefill_worker_id == "p1"
    # A lease on a worker that switched is still released when its client goes.
    t = p.submit("c", 16)
    t.stage, t.prefill_worker_id, t.handle = Stage.PENDING_DECODE, "p1", kv_handle("p1", "c", 16)
    assert p.placement.abort("c") == [ReleaseKV("p1", "c", 1)]


def test_reports_of_a_worker_that_left_the_decode_role_still_finish_its_sequences():
    p, ctl = _parts(workers=("p0", "d0", "d1"))
    t = p.submit("s", 8)
    t.stage, t.worker_id = Stage.DECODE, "d1"
    ctl.begin(p.w("d1"), Role.PREFILL, "test", 0.0)
    assert ctl.old_role_work(p.w("d1")) == 1
    p.placement.reported(p.report("d1", free=99, finished=("s",)))
    assert "s" not in p.state.tracked and ctl.old_role_work(p.w("d1")) == 0


def test_autoscaling_bounds_span_both_pools_with_role_switching():
    """A fixed cluster (each pool's min = max = its start size): after a switch the pools are 2 + 1,
    and autoscaling neither drains the switched worker nor adds one."""
    p, ctl = _parts(workers=("p0", "d0", "d1"))
    ctl.begin(p.w("d1"), Role.PREFILL, "test", 0.0)
    ctl.complete(p.w("d1"), 0.0)
    assert p.pools.bounds(Role.PREFILL) == (2, 2) and p.pools.bounds(Role.DECODE) == (1, 1)
    for now in range(0, 60):
        assert p.pools.tick(float(now)) == []
    assert not any(w.draining for w in p.state.workers())
    # With room to grow (decode_max_workers 3), the pool a switch is feeding is held.
    q, qc = _parts(workers=("p0", "d0", "d1"), decode_max_workers=3)
    q.state.pending_decode[:] = [f"x{i}" for i in range(40)]
    assert q.pools.tick(1000.0, hold=frozenset({Role.DECODE})) == []
    assert q.pools.tick(1010.0, hold=frozenset({Role.DECODE})) == []
    assert [w.role for w in q.pools.tick(1020.0)] == [Role.DECODE]


def test_role_switching_is_refused_where_it_cannot_work():
    with pytest.raises(ServeConfigError, match="prefill pool"):
        Parts((), role_switching=True, num_prefill_workers=0, num_decode_workers=2)
    with pytest.raises(ServeConfigError, match="prefill_tp = decode_tp"):
        Parts((), role_switching=True, num_prefill_workers=1, decode_tp=2, worker_num_cpus=1)
    with pytest.raises(ServeConfigError, match="ttft_target_ms"):
        Parts((), ttft_target_ms=0)


def test_a_switch_and_a_drain_never_take_the_same_worker():
    """The autoscaler drains only workers that are not leaving, the controller moves only workers that
    take work: a draining worker is never switched, a switching one never drained."""
    p, ctl = _parts(workers=("p0", "d0", "d1", "d2"), decode_min_workers=1)
    p.w("d0").draining = True
    _queue(p, "p0", 10 * TARGET)
    plan, when = _run(ctl, 1000.0, 10.0)
    assert plan is not None and plan[0].worker_id != "d0"
    ctl.begin(plan[0], plan[1], plan[2], when)
    for now in range(1100, 1200, 5):  # an idle decode pool: the autoscaler wants fewer decode workers
        p.pools.tick(float(now))
    assert not plan[0].draining and plan[0].switching_to is Role.PREFILL


def test_the_latency_targets_drive_autoscaling_too():
    """Without role switching the targets still count: a TTFT p90 over its target asks the prefill pool
    for one more worker, a step time over the TPOT target the decode pool (within their bounds)."""
    p = Parts(("p0", "d0"), prefill_max_workers=2, decode_max_workers=2, ttft_target_ms=200.0,
              tpot_target_ms=100.0, prefix_aware_routing=False)
    assert p.pools.desired(Role.PREFILL)[0] == 1 and p.pools.desired(Role.DECODE)[0] == 1
    for _ in range(10):
        p.state.latencies.record_ttft(0.5)
        p.state.latencies.record_step(0.05)
    want, why = p.pools.desired(Role.PREFILL)
    assert want == 2 and "TTFT p90 500 ms (target 200)" in why
    assert p.pools.desired(Role.DECODE)[0] == 1
    for _ in range(10):
        p.state.latencies.record_step(0.3)
    assert p.pools.desired(Role.DECODE)[0] == 2


def test_a_mixed_decode_worker_takes_long_prompts_whole_when_that_is_sooner():
    """A long prompt (over local_prefill_max_tokens) stays off the decode pool, unless a decode worker
    is mixed: then it runs there whole when that worker would get through it sooner than the prefill
    pool (the same rule as a short prompt's local prefill)."""
    p, ctl = _parts(workers=("p0", "d0", "d1"), local_prefill_max_tokens=64)
    for d in ("d0", "d1"):
        p.w(d).report = p.report(d, free=90)
    _queue(p, "p0", 2000)  # a busy prefill worker
    t = p.submit("long", 200)
    [a] = p.placement.place_prefill(t)
    assert type(a).__name__ == "ToPrefill"  # no mixed worker: the prefill pool, however busy
    d = ctl.set_mixed(p.w("d1"), True, "test", 1000.0)
    assert (d.from_role, d.to_role, d.completed_at) == ("decode", "mixed", 1000.0)
    t2 = p.submit("long2", 200, first=500)
    [a2] = p.placement.place_prefill(t2)
    assert type(a2).__name__ == "RunWhole" and a2.worker.worker_id == "d1"
    assert p.state.counters.local_prefills == 1
    # Leaving decode clears it; the controller's switches are whole roles.
    ctl.begin(p.w("d1"), Role.PREFILL, "test", 1001.0)
    assert not p.w("d1").mixed and ctl.decisions[-1].from_role == "mixed"
