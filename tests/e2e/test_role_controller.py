"""The role controller through the Ray deployment (tiny random-weight llama): it switches on its own
within seconds of a shift in the load, both ways, and every request completes. (Its decisions are
unit-tested on a simulated clock in tests/deployments/cluster/test_roles.py; switches under load keep
greedy output: test_role_switching.py.)"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from deployments.config import ServeConfig
from engine import SamplingParams
from helpers import local_ray, pdserve_router, wait_no_leaks
from test_role_switching import BASE, _generate, _stats  # noqa: F401 - the same cluster settings and client


@pytest.fixture(scope="module")
def ray_cluster():
    with local_ray(4, namespace="pdserve-role-controller"):
        yield


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.mark.slow  # ~70-160 s on 2 cores; the controller's decisions are unit-tested on a simulated clock
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
