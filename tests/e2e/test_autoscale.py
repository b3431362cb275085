"""Pools that live: a fake multi-node cluster with `prefill` / `decode` node types; actors land on the
right nodes; a burst scales the prefill pool 1 -> 2 and back down after it, losing no request."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray
from ray.cluster_utils import Cluster

from deployments.app import get_or_create_router, shutdown_router
from deployments.config import ServeConfig
from deployments.frontend.router_client import RouterBackend
from deployments.frontend.stream_hub import StreamHub
from engine import SamplingParams
from helpers import wait_for


@pytest.fixture(scope="module")
def fake_cluster():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    prefill_node = cluster.add_node(num_cpus=2, resources={"prefill": 2})
    decode_node = cluster.add_node(num_cpus=1, resources={"decode": 1})
    ray.init(address=cluster.address, namespace="pdserve-autoscale", log_to_driver=False)
    cluster.wait_for_nodes()
    yield cluster, prefill_node.node_id, decode_node.node_id
    shutdown_router()
    ray.shutdown()
    cluster.shutdown()


def test_placement_and_prefill_burst_scales_up_and_down(fake_cluster):
    _, prefill_node, decode_node = fake_cluster
    cfg = ServeConfig.from_dict(dict(num_prefill_workers=1, prefill_max_workers=2, num_decode_workers=1,
                      prefill_resources={"prefill": 1}, decode_resources={"decode": 1}, kv_cache_memory_mb=96,
                      prefill_target_queued_tokens=400, upscale_delay_s=0.5, downscale_delay_s=2.0,
                      max_num_batched_tokens=256, local_prefill_max_tokens=0))
    # (local_prefill_max_tokens=0: the whole burst queues on the prefill pool, none of it spills onto
    # the decode worker, so the burst outlasts the new prefill worker's start.)
    router = get_or_create_router(cfg)
    ray.get(router.wait_ready.remote(600), timeout=700)
    stats = ray.get(router.stats.remote())
    assert [w["node_id"] for w in stats["prefill"].values()] == [prefill_node]
    assert [w["node_id"] for w in stats["decode"].values()] == [decode_node]

    hub = StreamHub()
    backend = RouterBackend(router, hub, "hub-burst", request_timeout_s=300)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompts = [[100 + (i * 7 + j) % 4000 for j in range(300)] for i in range(16)]

    async def burst():
        async def one(i):
            toks = []
            async for d in backend.generate(f"b{i}", prompts[i], params):
                assert d.finish_reason != "error", d.error
                toks += d.token_ids
            return toks
        return await asyncio.wait_for(asyncio.gather(*[one(i) for i in range(len(prompts))]), 600)

    t0 = time.time()
    outs = asyncio.run(burst())
    t_done = time.time()
    assert all(len(o) == 4 for o in outs)  # nothing lost
    stats = ray.get(router.stats.remote())
    ups = [d for d in stats["decisions"] if d["pool"] == "prefill" and d["action"] == "scale_up"]
    assert ups and ups[0]["to"] == 2, stats["decisions"]
    # The burst can end before the new worker has loaded its model (a loaded 2-core host): wait for it.
    def new_workers():
        return [w for w in ray.get(router.stats.remote())["prefill"].values() if w["created_at"] > t0]
    new = wait_for(new_workers, lambda ws: ws and all(w["ready"] for w in ws), timeout_s=180,
                   what="the scaled-up prefill worker ready")
    assert all(w["node_id"] == prefill_node for w in new)
    if new[0]["ready_at"] and new[0]["ready_at"] < t_done - 6.0:
        # It joined while the burst still queued on the first worker: queued prompts moved to it.
        assert stats["counters"]["rebalanced"] > 0, (stats["counters"], new[0]["ready_at"] - t0, t_done - t0)

    # The burst is over: back down to one worker, after draining.
    stats = wait_for(lambda: ray.get(router.stats.remote()), lambda stats: stats["pools"]["prefill"]["size"] == 1,
                     timeout_s=60, interval_s=0.5, what="prefill pool back to 1 worker")
    assert any(d["pool"] == "prefill" and d["action"] == "scale_down" for d in stats["decisions"])
    assert stats["counters"]["failed"] == 0
    use = ray.get(router.check_integrity.remote())
    assert all(u["num_used_blocks"] == 0 for u in use.values())
