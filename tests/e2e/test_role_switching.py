"""Workers that change role (`role_switching`), through the Ray deployment on a tiny random-weight llama:
a decode worker moved to the prefill pool under load and back loses no request and every stream is
greedy-identical to the offline engine; the moved worker then really does the other role's work; a
switch racing the worker's death leaves no leaked block; and the controller switches on its own
within seconds of a shift in the load, both ways."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import ray

from deployments.config import ServeConfig
from deployments.frontend.router_client import RouterBackend
from deployments.frontend.stream_hub import StreamHub
from engine import EngineConfig, LLMEngine, SamplingParams
from helpers import local_ray, pdserve_router, run_offline, wait_for, wait_no_leaks

PROMPTS = [[1 + (i * 37 + j * 11) % 4000 for j in range(n)] for i, n in enumerate((5, 23, 40, 9, 31, 17))]
PARAMS = SamplingParams(max_tokens=160, temperature=0, ignore_eos=True)
BASE = dict(num_prefill_workers=1, num_decode_workers=2, role_switching=True, kv_cache_memory_mb=16,
            block_size=4, dtype="float32", max_num_seqs=8, health_check_timeout_s=5.0, role_switch_drain_s=0.3,
            autoscale_interval_s=0.25)


@pytest.fixture(scope="module")
def ray_cluster():
    with local_ray(4, namespace="pdserve-roles"):
        yield


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def reference(model):
    eng = LLMEngine(EngineConfig(model=model, num_kv_blocks=512, block_size=4, dtype="float32"))
    return [o.token_ids for o in run_offline(eng, PROMPTS, PARAMS)]


def _generate(router, prompts, params=PARAMS, on_progress=None, tag="r"):
    backend = RouterBackend(router, StreamHub(), f"hub-{tag}", request_timeout_s=120)
    progress = [0] * len(prompts)

    async def one(i, p):
        toks = []
        async for d in backend.generate(f"{tag}{i}-{time.monotonic_ns()}", p, params):
            assert d.finish_reason != "error", d.error
            toks += d.token_ids
            progress[i] = len(toks)
        return toks

    async def run():
        tasks = [asyncio.create_task(one(i, p)) for i, p in enumerate(prompts)]
        if on_progress is not None:
            await on_progress(progress)
        return await asyncio.wait_for(asyncio.gather(*tasks), 300)

    return asyncio.run(run())


def _once_streaming(action):
    """An `on_progress` that runs `action()` once every stream has its first tokens."""
    async def go(progress):
        deadline = time.monotonic() + 120
        while min(progress) < 3:
            assert time.monotonic() < deadline, progress
            await asyncio.sleep(0.02)
        await action()
    return go


def _stats(router):
    return ray.get(router.stats.remote(), timeout=30)


def _pools_are(router, prefill: set[str], decode: set[str]):
    return wait_for(lambda: _stats(router), lambda s: set(s["prefill"]) == prefill and set(s["decode"]) == decode
                    and all(not w["switching_to"] for w in (*s["prefill"].values(), *s["decode"].values())),
                    timeout_s=60, interval_s=0.2, what=f"pools {prefill} / {decode}")


def test_a_worker_switched_under_load_both_ways_loses_nothing(ray_cluster, model, reference):
    cfg = ServeConfig.from_dict(dict(BASE, model=model, role_switch_dwell_s=1000.0))  # only asked switches
    with pdserve_router(cfg) as router:
        worker = ray.get(router.workers.remote())["pdserve-decode-0"]

        async def to_prefill():
            d = await router.switch_role.remote("pdserve-decode-0", "prefill")
            assert (d["from"], d["to"]) == ("decode", "prefill")

        assert _generate(router, PROMPTS, on_progress=_once_streaming(to_prefill), tag="a") == reference
        s = _pools_are(router, {"pdserve-prefill-0", "pdserve-decode-0"}, {"pdserve-decode-1"})
        assert s["roles"]["decisions"][-1]["completed_at"] is not None
        assert ray.get(worker.current_role.remote()).value == "prefill"

        # It now computes prompts for the decode pool: its engine steps with no sequence of its own.
        steps = ray.get(router.check_integrity.remote())["pdserve-decode-0"]["num_steps"]
        assert _generate(router, PROMPTS, tag="b") == reference
        assert ray.get(router.check_integrity.remote())["pdserve-decode-0"]["num_steps"] > steps

        async def to_decode():
            d = await router.switch_role.remote("pdserve-decode-0", "decode")
            assert (d["from"], d["to"]) == ("prefill", "decode")

        assert _generate(router, PROMPTS, on_progress=_once_streaming(to_decode), tag="c") == reference
        _pools_are(router, {"pdserve-prefill-0"}, {"pdserve-decode-0", "pdserve-decode-1"})
        assert ray.get(worker.current_role.remote()).value == "decode"
        with pytest.raises(ray.exceptions.RayTaskError, match="last prefill worker"):
            ray.get(router.switch_role.remote("pdserve-prefill-0", "decode"))
        assert _generate(router, PROMPTS, tag="d") == reference
        wait_no_leaks(router)
        assert _stats(router)["counters"]["role_switches"] == 2


def test_a_switch_racing_the_workers_death_leaves_nothing_behind(ray_cluster, model, reference):
    cfg = ServeConfig.from_dict(dict(BASE, model=model, role_switch_dwell_s=1000.0, role_switch_drain_s=30.0))
    with pdserve_router(cfg) as router:
        async def switch_then_die():
            await router.switch_role.remote("pdserve-decode-1", "prefill")
            ray.kill((await router.workers.remote())["pdserve-decode-1"])

        assert _generate(router, PROMPTS, on_progress=_once_streaming(switch_then_die), tag="e") == reference
        s = wait_for(lambda: _stats(router), lambda s: s["pools"]["decode"]["ready"] == 2 and
                     s["pools"]["prefill"]["ready"] == 1, timeout_s=120, interval_s=0.5, what="pools refilled")
        assert "pdserve-decode-1" not in s["decode"] and "pdserve-decode-1" not in s["prefill"]
        assert s["counters"]["worker_deaths"] == 1 and not s["roles"]["switching"]
        wait_no_leaks(router)


def test_the_controller_follows_a_shift_in_the_load_both_ways(ray_cluster, model):
    """Long prompts with one-token answers flood the prefill queue: a decode worker becomes a prefill
    worker within seconds. Then short prompts with long answers fill the decode slots: a prefill
    worker goes to decode. Every request still completes (their texts are checked in the tests above)."""
    cfg = ServeConfig.from_dict(dict(
        BASE, model=model, prefill_target_queued_tokens=64, max_num_batched_tokens=16, decode_target_waiting=1,
        max_num_seqs=2, role_switch_hold_s=0.5, role_switch_dwell_s=2.0, decode_max_prefill_tokens=16))
    with pdserve_router(cfg) as router:
        long_prompts = [[1 + (i * 13 + j * 7) % 4000 for j in range(300)] for i in range(40)]
        t0 = time.monotonic()
        first: list[float] = []

        async def watch(progress):
            while not first:
                s = await router.stats.remote()
                if any(d["to"] == "prefill" for d in s["roles"]["decisions"]):
                    first.append(time.monotonic() - t0)
                    return
                assert time.monotonic() - t0 < 60, s["roles"]
                await asyncio.sleep(0.1)

        out = _generate(router, long_prompts, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
                        on_progress=watch, tag="f")
        assert all(len(o) == 1 for o in out) and first, first
        s = _stats(router)
        d = next(d for d in s["roles"]["decisions"] if d["to"] == "prefill")
        assert d["from"] == "decode" and "queued prompt tokens" in d["reason"]

        short = [[1 + (i * 5 + j) % 4000 for j in range(4)] for i in range(12)]
        t1 = time.monotonic()
        seen: list[float] = []

        async def watch_back(progress):
            while not seen:
                s = await router.stats.remote()
                if any(d["to"] == "decode" for d in s["roles"]["decisions"]):
                    seen.append(time.monotonic() - t1)
                    return
                assert time.monotonic() - t1 < 60, json.dumps({k: s[k] for k in ("roles", "tracked_by_stage", "prefill", "decode", "num_pending_decode", "moves")}, indent=1, default=str)
                await asyncio.sleep(0.1)

        out = _generate(router, short, SamplingParams(max_tokens=120, temperature=0, ignore_eos=True),
                        on_progress=watch_back, tag="g")
        assert all(len(o) == 120 for o in out) and seen, seen
        wait_no_leaks(router)
