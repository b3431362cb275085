"""`Pools`: worker names, the size each pool's queue asks for, scale-up and drain decisions with their
delays, replacement after a death, and moving queued prompts between prefill workers."""

from __future__ import annotations

from conftest import Parts

from deployments.cluster.actions import ToPrefill
from deployments.cluster.messages import Role
from deployments.cluster.pools import PoolSize, Rebalance, parse_worker_name, pool_size, worker_name
from deployments.cluster.state import Stage
from deployments.config import ServeConfig


def test_worker_names_round_trip_and_adoption_continues_the_numbering():
    assert worker_name(Role.DECODE, 3) == "pdserve-decode-3"
    assert parse_worker_name("pdserve-prefill-12") == (Role.PREFILL, 12)
    assert [parse_worker_name(n) for n in ("pdserve-router", "other-decode-1", "pdserve-decode-x")] == [None] * 3
    parts = Parts(())
    parts.pools.adopt("pdserve-decode-4", Role.DECODE, 4)
    assert [w.worker_id for w in parts.pools.fill()] == ["pdserve-prefill-0"]  # the decode pool is full
    assert parts.pools.new_worker(Role.DECODE).worker_id == "pdserve-decode-5"


def test_pool_sizes_default_their_bounds_to_the_start_size():
    cfg = ServeConfig(num_prefill_workers=2, prefill_max_workers=4, num_decode_workers=3)
    assert pool_size(cfg, Role.PREFILL) == PoolSize(2, 2, 4)
    assert pool_size(cfg, Role.DECODE) == PoolSize(3, 3, 3)
    assert pool_size(ServeConfig(num_prefill_workers=0), Role.PREFILL) == PoolSize(0, 0, 0)


def test_the_prefill_pool_wants_one_worker_per_target_of_queued_prompt_tokens():
    parts = Parts((), prefill_max_workers=3, prefill_target_queued_tokens=1000, prefix_aware_routing=False)
    parts.start_pools()
    p0 = parts.state.prefill["pdserve-prefill-0"]
    p0.queued_prompt_tokens = 2500
    assert parts.pools.desired(Role.PREFILL) == (3, "2500 queued prompt tokens, target 1000/worker")
    p0.queued_prompt_tokens = 4500
    assert parts.pools.desired(Role.PREFILL)[0] == 3  # its max
    p0.queued_prompt_tokens = 0
    assert parts.pools.desired(Role.PREFILL)[0] == 1  # its min
    parts.submit("waiting", 1300)
    parts.state.unplaced.append("waiting")  # prompts no worker took yet count too
    assert parts.pools.desired(Role.PREFILL) == (2, "1300 queued prompt tokens, target 1000/worker")


def test_a_scale_up_waits_for_its_signal_to_hold_and_for_no_replacement_under_way():
    parts = Parts((), prefill_max_workers=3, prefill_target_queued_tokens=1000, upscale_delay_s=2.0,
                  prefix_aware_routing=False)
    parts.start_pools()
    parts.state.prefill["pdserve-prefill-0"].queued_prompt_tokens = 2500
    parts.pools.replacing[Role.PREFILL] = 1
    assert parts.pools.tick(100.0) == [] and parts.pools.tick(103.0) == []
    parts.pools.replacing[Role.PREFILL] = 0
    started = parts.pools.tick(104.0)
    assert [(w.worker_id, w.ready) for w in started] == [("pdserve-prefill-1", False), ("pdserve-prefill-2", False)]
    assert len(parts.state.prefill) == 3 and parts.state.counters.scale_ups == 1
    decision = parts.pools.decisions[-1].as_dict()
    assert {k: v for k, v in decision.items() if k != "time"} == {
        "pool": "prefill", "action": "scale_up", "from": 1, "to": 3,
        "reason": "2500 queued prompt tokens, target 1000/worker"}
    assert parts.pools.tick(110.0) == []  # the pool has the size it wants now
    assert parts.pools.scale[Role.PREFILL].desired == 3


def test_a_decode_worker_short_of_room_adds_one():
    parts = Parts((), decode_max_workers=2, decode_target_waiting=4, prefix_aware_routing=False)
    parts.start_pools()
    parts.state.pending_decode.extend(f"r{i}" for i in range(5))
    assert parts.pools.desired(Role.DECODE) == (2, "5 waiting for a slot, KV use 0%, 0 running")
    d0 = parts.state.decode["pdserve-decode-0"]
    parts.state.pending_decode.clear()
    d0.report = parts.report(d0.worker_id, free=10)  # 90% of its blocks in use
    assert parts.pools.desired(Role.DECODE) == (2, "0 waiting for a slot, KV use 90%, 0 running")


def test_an_idle_pool_drains_its_least_loaded_worker_after_the_delay_then_closes_it():
    parts = Parts((), num_decode_workers=2, decode_min_workers=1, downscale_delay_s=15.0, prefix_aware_routing=False)
    parts.start_pools()
    d0, d1 = parts.state.decode["pdserve-decode-0"], parts.state.decode["pdserve-decode-1"]
    for d in (d0, d1):
        d.report = parts.report(d.worker_id, free=100)
    busy = parts.submit("busy", 10)
    busy.stage, busy.worker_id = Stage.DECODE, d0.worker_id
    assert parts.pools.tick(1000.0) == [] and parts.pools.tick(1014.9) == []
    assert not d0.draining and not d1.draining
    assert parts.pools.tick(1015.0) == []
    assert d1.draining and not d0.draining  # d0 runs a sequence
    assert parts.pools.decisions[-1].reason.endswith("; draining pdserve-decode-1")
    assert parts.state.counters.scale_downs == 1
    straggler = parts.submit("straggler", 10)
    straggler.stage, straggler.worker_id = Stage.DECODE, d1.worker_id
    assert parts.pools.finished_drains() == []  # it still runs one
    parts.placement.finished(d1.worker_id, "straggler")
    assert parts.pools.finished_drains() == [d1]
    assert list(parts.state.decode) == ["pdserve-decode-0"]
    assert parts.placement.pick_decode(1) is d0


def test_a_dead_workers_pool_is_refilled_to_its_minimum_or_the_autoscalers_wish():
    parts = Parts((), num_decode_workers=2, decode_max_workers=4, prefix_aware_routing=False)
    parts.start_pools()
    assert parts.state.remove_worker(parts.state.decode["pdserve-decode-0"])
    assert [w.worker_id for w in parts.pools.refill(Role.DECODE)] == ["pdserve-decode-2"]
    parts.pools.scale[Role.DECODE].desired = 4
    assert [w.worker_id for w in parts.pools.refill(Role.DECODE)] == ["pdserve-decode-3", "pdserve-decode-4"]
    assert parts.pools.refill(Role.DECODE) == []


def test_queued_prompts_move_from_a_long_prefill_queue_to_a_short_one():
    parts = Parts(("p0", "p1", "d0"), max_num_batched_tokens=256, prefix_aware_routing=False)
    p0, p1 = parts.w("p0"), parts.w("p1")
    p0.queued_prompt_tokens = 1000
    assert parts.pools.rebalance_plan() == Rebalance(p0, p1, 500)  # split the difference
    p0.queued_prompt_tokens = 400  # within two steps of the other: leave it
    assert parts.pools.rebalance_plan() is None
    p0.queued_prompt_tokens, p0.draining = 100, True  # draining: hand over everything not started
    assert parts.pools.rebalance_plan() == Rebalance(p0, p1, 100)
    p1.ready = False
    assert parts.pools.rebalance_plan() is None


def test_released_prompts_are_queued_on_the_short_queue_or_placed_again_if_it_is_gone():
    parts = Parts(("p0", "p1", "p2", "d0"), prefix_aware_routing=False)
    p0, p1, p2 = parts.w("p0"), parts.w("p1"), parts.w("p2")
    a, b = parts.submit("a", 300), parts.submit("b", 200)
    for t in (a, b):
        parts.placement.send_to_prefill(t, p0)
    p2.queued_prompt_tokens = 5000
    assert parts.pools.rebalanced(Rebalance(p0, p1, 250), [b.req, parts.submit("gone", 10).req]) == [ToPrefill(b, "p1")]
    assert (p0.queued_prompt_tokens, p1.queued_prompt_tokens, b.worker_id) == (300, 200, "p1")
    assert parts.state.counters.rebalanced == 1
    assert parts.state.remove_worker(p1)
    assert parts.pools.rebalanced(Rebalance(p0, p1, 300), [a.req]) == [ToPrefill(a, "p0")]  # p0 beats p2 now
    assert (p0.queued_prompt_tokens, a.worker_id, parts.state.counters.rebalanced) == (300, "p0", 2)
