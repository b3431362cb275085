"""Clocks differ between machines. Every bed host has its own monotonic clock (weeks apart: a time
namespace each), so the other multi-node tests already fail if anything compares monotonic times
across hosts. Here the decode host's wall clock also runs ahead of the prefill host's by more than a
KV lease: a lease must still be judged on one side only, so every request still completes."""

from __future__ import annotations

import time

import pytest
import ray

from deployments.config import RAY_ENV_DEFAULTS, ServeConfig
from engine import EngineConfig, LLMEngine, SamplingParams
from helpers import run_offline, wait_no_leaks
from netbed import HostSpec, on_host, start_pdserve, stream_all

pytestmark = pytest.mark.multinode

LEASE_S = 5.0
SKEW_S = 6 * LEASE_S
HOSTS = [HostSpec("head", 0, {"router": 1}), HostSpec("pre", 1, {"prefill": 1}),
         HostSpec("dec", 1, {"decode": 1}, wall_clock_skew_s=SKEW_S)]
SETTINGS = dict(num_prefill_workers=1, num_decode_workers=1, prefill_resources={"prefill": 1},
                decode_resources={"decode": 1}, router_resources={"router": 1}, kv_cache_memory_mb=32, max_num_seqs=8,
                local_prefill_max_tokens=0,
                kv_lease_s=LEASE_S, health_check_timeout_s=5.0, request_timeout_s=30.0)
PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(make_bed, tiny_model_dir):
    local = tiny_model_dir("llama")
    bed = make_bed(HOSTS[0], HOSTS[1:], env=dict(RAY_ENV_DEFAULTS))
    model = bed.provision(local, "models/tiny-llama")
    router, hub = start_pdserve(ServeConfig.from_dict({**SETTINGS, "model": model}))
    return bed, router, hub, LLMEngine(EngineConfig(model=local, num_kv_blocks=256))


@ray.remote(num_cpus=0)
def _clocks() -> tuple[float, float]:
    return time.time(), time.monotonic()


def test_the_hosts_clocks_differ(cluster):
    bed = cluster[0]
    here_wall, here_mono = time.time(), time.monotonic()
    pre_wall, pre_mono = ray.get(_clocks.options(scheduling_strategy=on_host(bed, "pre")).remote(), timeout=60)
    dec_wall, dec_mono = ray.get(_clocks.options(scheduling_strategy=on_host(bed, "dec")).remote(), timeout=60)
    assert abs(pre_wall - here_wall) < 5 and abs(dec_wall - pre_wall - SKEW_S) < 5
    assert min(abs(pre_mono - here_mono), abs(dec_mono - pre_mono), abs(dec_mono - here_mono)) > 86400


def test_kv_leases_hold_when_the_decode_hosts_wall_clock_runs_ahead(cluster):
    bed, router, hub, offline = cluster
    prompts = [[100 + i * 53 + j for j in range(40)] for i in range(3)]
    got, _ = stream_all(router, hub, prompts, PARAMS, timeout_s=60)
    assert got == [o.token_ids for o in run_offline(offline, prompts, PARAMS)]
    wait_no_leaks(router)
