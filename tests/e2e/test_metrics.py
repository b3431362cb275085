"""Metrics end to end: run requests through the router, scrape Ray's Prometheus endpoint, and find
every pdserve_* series there and moving. Ray exports them with a `ray_` prefix."""

from __future__ import annotations

import asyncio
import uuid
from collections import defaultdict

import httpx
import pytest
import ray

from deployments.config import ServeConfig
from deployments.frontend.backend import QueueFullError
from deployments.frontend.router_client import RouterBackend
from deployments.frontend.stream_hub import StreamHub
from engine import SamplingParams
from helpers import free_port, local_ray, pdserve_router, wait_for

NUM_REQUESTS = 8
MAX_QUEUED = 6  # a burst of NUM_REQUESTS overflows it: some are rejected
MAX_TOKENS = 12

# Series that must exist and be > 0 after the load (counters, and the _count of histograms).
MOVED = [
    "pdserve_requests_submitted_total", "pdserve_requests_rejected_total",
    "pdserve_batch_size_count", "pdserve_step_tokens_count", "pdserve_step_seconds_count",
    "pdserve_prefill_tokens_total", "pdserve_decode_tokens_total",
    "pdserve_kv_transfer_bytes_total", "pdserve_kv_transfer_seconds_count",
    "pdserve_time_to_first_token_seconds_count", "pdserve_time_per_output_token_seconds_count",
    "pdserve_inter_token_latency_seconds_count", "pdserve_e2e_request_latency_seconds_count",
    "pdserve_requests_total", "pdserve_prompt_tokens_total", "pdserve_generation_tokens_total",
    "pdserve_pool_workers", "pdserve_prefix_cache_hit_tokens_total", "pdserve_prompt_tokens_cached_total",
    "pdserve_kv_pair_transfers_total", "pdserve_kv_pair_bytes_total", "pdserve_kv_pair_probe_gbps",
    "pdserve_kv_pair_live_gbps",
]
# Gauges that only have to be there (they are back to 0 once the load is over).
PRESENT = ["pdserve_queue_depth", "pdserve_running_seqs", "pdserve_waiting_seqs", "pdserve_kv_blocks_used",
           "pdserve_kv_cache_usage"]


def _scrape(port: int) -> dict[str, float]:
    """Sum of every pdserve sample by series name (labels dropped, the `ray_` prefix removed)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    out: dict[str, float] = defaultdict(float)
    for line in text.splitlines():
        if line.startswith("ray_pdserve_"):
            name = line.split("{", 1)[0].split(" ", 1)[0].removeprefix("ray_")
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


def _missing(m: dict[str, float]) -> list[str]:
    """The series of MOVED that are absent or still 0, and those of PRESENT that are absent."""
    return [k for k in MOVED if m.get(k, 0) <= 0] + [k for k in PRESENT if k not in m]


@pytest.fixture(scope="module")
def cluster():
    port = free_port()
    cfg = ServeConfig.from_dict(dict(num_prefill_workers=1, num_decode_workers=1, kv_cache_memory_mb=64,
                                     max_num_seqs=8, max_queued_requests=MAX_QUEUED))
    with (local_ray(4, namespace="pdserve-tests", _metrics_export_port=port,
                    _system_config={"metrics_report_interval_ms": 1000}),
          pdserve_router(cfg) as router):
        hub = StreamHub()
        yield router, hub, port


def test_metrics_exported_and_moving_under_load(cluster):
    router, hub, port = cluster
    backend = RouterBackend(router, hub, "hub-metrics", request_timeout_s=120)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)

    async def one(i: int) -> int | None:
        try:
            n = 0
            async for d in backend.generate(f"m{i}-{uuid.uuid4().hex[:6]}", list(range(100, 140 + i)), params):
                assert d.finish_reason != "error", d.error
                n += len(d.token_ids)
            return n
        except QueueFullError:
            return None

    async def load() -> list[int | None]:
        return await asyncio.wait_for(asyncio.gather(*[one(i) for i in range(NUM_REQUESTS)]), 120)

    got = asyncio.run(load())
    served = [n for n in got if n is not None]
    assert served and all(n == MAX_TOKENS for n in served), got
    assert len(served) < NUM_REQUESTS, "the burst should overflow max_queued_requests"
    counters = ray.get(router.stats.remote())["counters"]
    assert counters["rejected"] == NUM_REQUESTS - len(served)

    async def again() -> int:  # the burst's prompts share 2 full blocks; this one comes after them
        deltas = [d async for d in backend.generate(f"again-{uuid.uuid4().hex[:6]}", list(range(100, 150)), params)]
        assert sum(len(d.token_ids) for d in deltas) == MAX_TOKENS and deltas[-1].finish_reason == "length"
        return deltas[0].num_cached_tokens  # the first event carries the prefill's cache hits

    assert asyncio.run(asyncio.wait_for(again(), 60)) == 32

    m = wait_for(lambda: _scrape(port), lambda m: not _missing(m) and m["pdserve_requests_total"] >= len(served) + 1,
                 timeout_s=30, interval_s=1.0, what="every series exported and moving")
    assert m["pdserve_requests_rejected_total"] == counters["rejected"]
    assert m["pdserve_requests_submitted_total"] == len(served) + 1
    assert m["pdserve_generation_tokens_total"] == MAX_TOKENS * (len(served) + 1)
    assert m["pdserve_time_to_first_token_seconds_count"] == len(served) + 1
    assert m["pdserve_e2e_request_latency_seconds_count"] == len(served) + 1
    assert m["pdserve_prompt_tokens_cached_total"] >= 32 and m["pdserve_prefix_cache_hit_tokens_total"] >= 32
    assert m["pdserve_pool_workers"] == 2  # one prefill, one decode


def test_speculation_counters_export_differences_and_bench_reads_health():
    """No Ray needed: the worker side turns the engine's cumulative counters into increments (a new
    engine under the same id starts over), and `pdserve bench` diffs two /health readings."""
    from deployments.bench_report import server_speculation, speculation_delta
    from deployments.metrics import spec_increments
    from engine.spec.speculator import SpecStats

    wid = f"w-{uuid.uuid4().hex[:6]}"
    assert spec_increments(wid, SpecStats("ngram", 8, 5, 9, 4)) == (8, 5, 9)
    assert spec_increments(wid, SpecStats("ngram", 12, 6, 11, 5)) == (4, 1, 2)
    assert spec_increments(wid, SpecStats("ngram", 2, 1, 2, 1)) == (2, 1, 2)  # restarted: from zero

    def health(**workers):
        spec = lambda d, a, e, r: {"method": "suffix", "num_drafted": d, "num_accepted": a, "num_emitted": e,
                                   "num_verified_rows": r}
        return {"status": "ok", "router": {"decode": {w: {"speculation": spec(*v) if v else None}
                                                      for w, v in workers.items()}}}

    before = server_speculation(health(a=(10, 4, 8, 4), b=None))
    after = server_speculation(health(a=(30, 19, 29, 10), c=(5, 5, 7, 2)))
    d = speculation_delta(before, after)
    assert (d["num_drafted"], d["num_accepted"], d["num_emitted"], d["num_verified_rows"]) == (25, 20, 28, 8)
    assert d["method"] == "suffix" and d["acceptance_rate"] == 0.8 and d["mean_accepted_length"] == 3.5
    assert server_speculation({"status": "ok"}) == {} and speculation_delta({}, {}) is None
    assert server_speculation(health(a=None)) == {}
