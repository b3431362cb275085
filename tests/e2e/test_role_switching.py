"""Workers that change role (`role_switching`), through the Ray deployment on a tiny random-weight llama:
a decode worker moved to the prefill pool under load and back loses no request and every stream is
greedy-identical to the offline engine; the moved worker then really does the other role's work; a
switch racing the worker's death leaves no leaked block. (The controller deciding on its own:
test_role_controller.py.)"""

from __future__ import annotations

import asyncio
import time

import pytest
import ray

from deployments.config import ServeConfig
from deployments.status_cli import render
from engine import EngineConfig, LLMEngine, SamplingParams
from helpers import generate_via_router, local_ray, pdserve_router, run_offline, wait_for, wait_no_leaks

PROMPTS = [[1 + (i * 37 + j * 11) % 4000 for j in range(n)] for i, n in enumerate((5, 23, 40, 9, 31, 17))]
PARAMS = SamplingParams(max_tokens=96, temperature=0, ignore_eos=True)
# Long enough that the streams outlast the round of the role controller that hands them on (a switch
# asked for begins at once; its worker's sequences move at the next `autoscale_interval_s` tick).
LONG = SamplingParams(max_tokens=600, temperature=0, ignore_eos=True)
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
def router(ray_cluster, model):
    """Switches only when asked (`switch_role`): the controller's dwell outlasts the module. A worker
    leaving decode hands its sequences on at once (no drain time), so they move mid-stream."""
    with pdserve_router(ServeConfig.from_dict(dict(BASE, model=model, role_switch_dwell_s=1000.0,
                                                   role_switch_drain_s=0.0))) as r:
        yield r


@pytest.fixture(scope="module")
def engine(model):
    return LLMEngine(EngineConfig(model=model, num_kv_blocks=1024, block_size=4, dtype="float32"))


@pytest.fixture(scope="module")
def reference(engine):
    return [o.token_ids for o in run_offline(engine, PROMPTS, PARAMS)]


@pytest.fixture(scope="module")
def long_reference(engine):
    return [o.token_ids for o in run_offline(engine, PROMPTS, LONG)]


def _generate(router, prompts, params=PARAMS, on_progress=None, tag="r"):
    return generate_via_router(router, prompts, params, on_progress, tag)


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


def test_a_worker_switched_under_load_both_ways_loses_nothing(router, reference, long_reference):
    if True:
        worker = ray.get(router.workers.remote())["pdserve-decode-0"]
        before = _stats(router)["counters"]

        async def to_prefill():
            d = await router.switch_role.remote("pdserve-decode-0", "prefill")
            assert (d["from"], d["to"]) == ("decode", "prefill")

        assert _generate(router, PROMPTS, LONG, on_progress=_once_streaming(to_prefill), tag="a") == long_reference
        s = _pools_are(router, {"pdserve-prefill-0", "pdserve-decode-0"}, {"pdserve-decode-1"})
        assert s["roles"]["decisions"][-1]["completed_at"] is not None
        assert s["counters"]["migrations"] > before["migrations"]  # its sequences moved mid-stream
        shown = render({"status": "ok", "router": s})  # `pdserve status`
        assert "role switching: prefill" in shown and "pdserve-decode-0" in shown and "decode -> prefill" in shown
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

        # Mixed: the same worker also runs prompts whole, whatever their length (at once: same pool).
        d = ray.get(router.switch_role.remote("pdserve-decode-0", "mixed"))
        assert (d["from"], d["to"]) == ("decode", "mixed") and d["completed_at"] is not None
        s = _stats(router)
        assert s["roles"]["mixed"] == ["pdserve-decode-0"] and s["decode"]["pdserve-decode-0"]["mixed"]
        assert _generate(router, PROMPTS, tag="m") == reference
        ray.get(router.switch_role.remote("pdserve-decode-0", "decode"))
        assert _stats(router)["roles"]["mixed"] == []
        wait_no_leaks(router)
        assert _stats(router)["counters"]["role_switches"] == 4


def test_a_switch_racing_the_workers_death_leaves_nothing_behind(router, reference):
    """(After the test above: the module's router has switched twice.)"""
    if True:
        async def switch_then_die():
            await router.switch_role.remote("pdserve-decode-1", "prefill")
            ray.kill((await router.workers.remote())["pdserve-decode-1"])

        assert _generate(router, PROMPTS, on_progress=_once_streaming(switch_then_die), tag="e") == reference
        s = wait_for(lambda: _stats(router), lambda s: s["pools"]["decode"]["ready"] == 2 and
                     s["pools"]["prefill"]["ready"] == 1, timeout_s=120, interval_s=0.5, what="pools refilled")
        assert "pdserve-decode-1" not in s["decode"] and "pdserve-decode-1" not in s["prefill"]
        assert s["counters"]["worker_deaths"] == 1 and not s["roles"]["switching"]
        assert s["counters"]["role_switches"] == 5
        wait_no_leaks(router)
