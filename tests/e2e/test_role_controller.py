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
from helpers import generate_via_router, local_ray, pdserve_router, wait_no_leaks
from test_role_switching import BASE, _stats


@pytest.fixture(scope="module")
def ray_cluster():
    with local_ray(4, namespace="pdserve-role-controller"):
        yield


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama")


def _until_switch_to(router, role: str, seen: list[float], within_s: float = 60.0):
    """An `on_progress` that waits (beside the streams) for the router's first switch to `role`, and
    appends how long it took; fails with the router's state after `within_s`."""
    async def watch(progress):
        t0 = time.monotonic()
        while True:
            s = await router.stats.remote()
            if any(d["to"] == role for d in s["roles"]["decisions"]):
                seen.append(time.monotonic() - t0)
                return
            assert time.monotonic() - t0 < within_s, json.dumps(
                {k: s[k] for k in ("roles", "tracked_by_stage", "prefill", "decode", "num_pending_decode")},
                indent=1, default=str)
            await asyncio.sleep(0.1)
    return watch


@pytest.mark.slow  # ~70-160 s on 2 cores; the controller's decisions are unit-tested on a simulated clock
def test_the_controller_follows_a_shift_in_the_load_both_ways(ray_cluster, model):
    """Long prompts with one-token answers flood the prefill queue: a decode worker becomes a prefill
    worker within seconds. Then short prompts with long answers fill the decode slots: a prefill
    worker goes to decode. Every request completes (their texts are checked in test_role_switching.py)."""
    cfg = ServeConfig.from_dict(dict(
        BASE, model=model, prefill_target_queued_tokens=64, max_num_batched_tokens=16, decode_target_waiting=1,
        max_num_seqs=2, role_switch_hold_s=0.5, role_switch_dwell_s=2.0, decode_max_prefill_tokens=16))
    with pdserve_router(cfg) as router:
        long_prompts = [[1 + (i * 13 + j * 7) % 4000 for j in range(300)] for i in range(40)]
        first: list[float] = []
        out = generate_via_router(router, long_prompts, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
                                  _until_switch_to(router, "prefill", first), tag="f")
        assert all(len(o) == 1 for o in out) and first, first
        d = next(d for d in _stats(router)["roles"]["decisions"] if d["to"] == "prefill")
        assert d["from"] == "decode" and "queued prompt tokens" in d["reason"]

        # NOTE: long enough (12 x 400 tokens through 2 slots: seconds) to outlast the dwell since the first
        # switch and the hold on a fast host; 120 tokens each were done in 1.8 s, before the dwell ran out.
        short = [[1 + (i * 5 + j) % 4000 for j in range(4)] for i in range(12)]
        seen: list[float] = []
        out = generate_via_router(router, short, SamplingParams(max_tokens=400, temperature=0, ignore_eos=True),
                                  _until_switch_to(router, "decode", seen), tag="g")
        assert all(len(o) == 400 for o in out) and seen, seen
        wait_no_leaks(router)
