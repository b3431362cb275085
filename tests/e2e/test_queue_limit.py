"""Over the router's queue limit a request is refused at once (the ingress turns it into 429), and the
refused requests leave nothing behind."""

from __future__ import annotations

import asyncio

import pytest
import ray

from deployments.config import ServeConfig
from deployments.frontend.backend import QueueFullError
from deployments.frontend.router_client import RouterBackend
from deployments.frontend.stream_hub import StreamHub
from engine import SamplingParams
from helpers import local_ray, pdserve_router


@pytest.fixture(scope="module")
def tiny_router(tiny_model_dir):
    cfg = ServeConfig.from_dict(dict(model=tiny_model_dir("llama"), max_queued_requests=2, kv_cache_memory_mb=8))
    with local_ray(2, namespace="pdserve-queue"), pdserve_router(cfg, timeout_s=300) as router:
        yield router


def test_queue_full_is_refused_at_once_and_leaks_nothing(tiny_router):
    router = tiny_router
    backend = RouterBackend(router, StreamHub(), "hub-q", request_timeout_s=60)
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)

    async def one(i):
        toks = []
        async for d in backend.generate(f"q{i}", [5 + i] * 200, params):
            toks += d.token_ids
        return toks

    async def burst():
        return await asyncio.gather(*[one(i) for i in range(12)], return_exceptions=True)

    results = asyncio.run(burst())
    refused = [r for r in results if isinstance(r, QueueFullError)]
    served = [r for r in results if isinstance(r, list)]
    assert refused and served, results
    assert all(r.retry_after_s > 0 for r in refused)
    assert all(len(r) == 64 for r in served)
    stats = ray.get(router.stats.remote())
    assert stats["counters"]["rejected"] == len(refused)
    use = ray.get(router.check_integrity.remote())
    assert all(u["num_used_blocks"] == 0 for u in use.values()), use
