"""Tensor-parallel workers through the Ray deployment (CPU, gloo, a tiny random-weight llama with 2 KV
heads): greedy output equals the offline single engine token for token, colocated (decode TP 2) and
disaggregated (prefill TP 1 -> decode TP 2, 2 -> 1, 2 -> 2: KV moves with every KV head). The router
sees one worker per placement group. A follower rank killed mid-stream takes its worker down; the
router moves its requests, which finish with the same text, and no block, actor or placement group
is left behind."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray

from deployments.cluster.tp_ranks import placement_group_name
from deployments.config import ServeConfig
from engine import EngineConfig, LLMEngine, SamplingParams
from helpers import generate_via_router, local_ray, pdserve_router, run_offline, wait_for, wait_no_leaks

PROMPTS = [[1 + (i * 37 + j * 11) % 4000 for j in range(n)] for i, n in enumerate((5, 23, 40, 9))]
PARAMS = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
BASE = dict(kv_cache_memory_mb=16, max_num_batched_tokens=64, block_size=4, dtype="float32")


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray for the module (8 logical CPUs: a TP-2 worker's group takes 2); each test starts
    and shuts down its own router and workers in it."""
    with local_ray(8, namespace="pdserve-tp"):
        yield


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama")  # 4 heads, 2 KV heads


@pytest.fixture(scope="module")
def reference(model):
    eng = LLMEngine(EngineConfig(model=model, num_kv_blocks=256, block_size=4, dtype="float32"))
    return [o.token_ids for o in run_offline(eng, PROMPTS, PARAMS)]


def _generate(router, prompts, params=PARAMS, on_progress=None):
    return generate_via_router(router, prompts, params, on_progress, tag="tp")


def _pg_states(worker_id: str) -> set[str]:
    """The states of the placement groups named after `worker_id` (earlier tests' routers used the
    same worker names: their groups show as REMOVED)."""
    return {pg["state"] for pg in ray.util.placement_group_table().values()
            if pg.get("name") == placement_group_name(worker_id)}


def _live_pg(worker_id: str) -> bool:
    return bool(_pg_states(worker_id) - {"REMOVED"})


LAYOUTS = [
    pytest.param(1, 2, id="prefill1-decode2"),
    pytest.param(0, 2, id="colocated2", marks=pytest.mark.slow),
    pytest.param(2, 1, id="prefill2-decode1", marks=pytest.mark.slow),
    pytest.param(2, 2, id="prefill2-decode2", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("prefill_tp, decode_tp", LAYOUTS)
def test_tp_serving_equals_the_single_engine(ray_cluster, model, reference, prefill_tp, decode_tp):
    colocated = prefill_tp == 0
    # local_prefill_max_tokens=0: every prompt goes through the prefill pool and its KV moves.
    cfg = ServeConfig.from_dict(dict(model=model, num_prefill_workers=0 if colocated else 1, num_decode_workers=1,
                                     prefill_tp=max(prefill_tp, 1), decode_tp=decode_tp, local_prefill_max_tokens=0,
                                     **BASE))
    with pdserve_router(cfg, timeout_s=300) as router:
        assert _generate(router, PROMPTS) == reference
        stats = ray.get(router.stats.remote())
        assert stats["pools"]["decode"]["size"] == 1  # one worker per placement group
        assert stats["pools"]["prefill"]["size"] == (0 if colocated else 1)
        workers = ray.get(router.workers.remote())
        followers = []
        for wid, actor in workers.items():
            tp = decode_tp if wid.startswith("pdserve-decode") else prefill_tp
            mine = ray.get(actor.tp_followers.remote())
            assert len(mine) == tp - 1
            assert ("CREATED" in _pg_states(wid)) == (tp > 1)
            followers += mine
        received = ray.get(workers["pdserve-decode-0"].kv_stats.remote())["num_received"]
        assert received == (0 if colocated else len(PROMPTS))
        wait_no_leaks(router)
    # the router's shutdown removed every placement group, and no rank outlived its worker
    assert not any(_live_pg(wid) for wid in workers)
    _assert_gone(followers)


def _num_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# (prefill TP, decode TP): 0 = colocated. One GPU a rank: a case needs prefill TP + decode TP GPUs.
GPU_LAYOUTS = [pytest.param(0, 2, id="colocated2"), pytest.param(2, 1, id="prefill2-decode1"),
               pytest.param(1, 2, id="prefill1-decode2")]


@pytest.mark.gpu
@pytest.mark.parametrize("prefill_tp, decode_tp", GPU_LAYOUTS)
def test_tp_workers_on_gpus_equal_the_single_engine(ray_cluster, model, prefill_tp, decode_tp):
    """On CUDA: each rank an actor with one GPU, each worker's ranks an NCCL group, the KV between the
    pools over the NCCL pair (scripts/gpu_check.sh's "tp" part). Equal to the single engine on one GPU."""
    need = prefill_tp + decode_tp
    if _num_gpus() < need:
        pytest.skip(f"prefill TP {prefill_tp} + decode TP {decode_tp} need {need} GPUs, one a rank "
                    f"(found {_num_gpus()})")
    eng = LLMEngine(EngineConfig(model=model, num_kv_blocks=256, block_size=4, dtype="float32", device="cuda"))
    want = [o.token_ids for o in run_offline(eng, PROMPTS, PARAMS)]
    del eng
    colocated = prefill_tp == 0
    cfg = ServeConfig.from_dict(dict(model=model, num_prefill_workers=0 if colocated else 1, num_decode_workers=1,
                                     prefill_tp=max(prefill_tp, 1), decode_tp=decode_tp, local_prefill_max_tokens=0,
                                     device="cuda", worker_num_gpus=1.0, **BASE))
    with pdserve_router(cfg, timeout_s=300) as router:
        assert _generate(router, PROMPTS) == want
        workers = ray.get(router.workers.remote())
        received = ray.get(workers["pdserve-decode-0"].kv_stats.remote())["num_received"]
        assert received == (0 if colocated else len(PROMPTS))
        wait_no_leaks(router)
    assert not any(_live_pg(wid) for wid in workers)


def _dead(actor) -> bool:
    try:
        ray.get(actor.ping.remote(), timeout=30)
    except ray.exceptions.RayActorError:
        return True
    return False


def _assert_gone(actors, timeout_s: float = 60.0) -> None:
    """Every one of `actors` ends within `timeout_s` (Ray ends an actor whose owner died, or whose
    placement group was removed, a moment after the fact)."""
    for a in actors:
        wait_for(lambda: _dead(a), timeout_s=timeout_s, interval_s=0.5, what=f"{a} ended")


@pytest.mark.slow
def test_a_follower_killed_mid_stream_moves_its_workers_requests(ray_cluster, model):
    prompts = PROMPTS * 2
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    eng = LLMEngine(EngineConfig(model=model, num_kv_blocks=256, block_size=4, dtype="float32"))
    want = [o.token_ids for o in run_offline(eng, prompts, params)]
    cfg = ServeConfig.from_dict(dict(model=model, num_prefill_workers=1, num_decode_workers=2, decode_tp=2,
                                     health_check_timeout_s=5.0, local_prefill_max_tokens=0, **BASE))
    with pdserve_router(cfg, timeout_s=300) as router:
        workers = ray.get(router.workers.remote())
        victim = workers["pdserve-decode-0"]
        followers = ray.get(victim.tp_followers.remote())
        assert len(followers) == 1
        before = ray.get(router.stats.remote())["counters"]

        async def kill(progress):
            deadline = time.monotonic() + 120
            while min(progress) < 5:  # every stream is decoding
                assert time.monotonic() < deadline, progress
                await asyncio.sleep(0.05)
            ray.kill(followers[0])

        assert _generate(router, prompts, params, kill) == want
        after = ray.get(router.stats.remote())["counters"]
        assert after["worker_deaths"] == before["worker_deaths"] + 1
        assert after["migrations"] > before["migrations"]
        with pytest.raises(ray.exceptions.RayActorError):  # rank 0 took itself down
            ray.get(victim.ping.remote(), timeout=30)
        wait_for(lambda: _live_pg("pdserve-decode-0"), lambda live: not live, timeout_s=30,
                 what="the dead worker's placement group removed")
        wait_for(lambda: ray.get(router.stats.remote())["pools"]["decode"]["ready"], lambda n: n == 2,
                 timeout_s=180, what="a replacement TP decode worker ready")
        wait_no_leaks(router)
        # Killing a worker (rank 0) ends its follower and its placement group too.
        workers = ray.get(router.workers.remote())
        other = next(w for w in workers if w.startswith("pdserve-decode") and w != "pdserve-decode-0")
        its_followers = ray.get(workers[other].tp_followers.remote())
        ray.kill(workers[other])
        _assert_gone(its_followers)
        wait_for(lambda: _live_pg(other), lambda live: not live, timeout_s=60, what=f"{other}'s placement group removed")
