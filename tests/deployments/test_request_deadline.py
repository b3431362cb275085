"""A request that makes no progress within `request_timeout_s` ends with a clear error, not a hang,
and the router is told to drop it. A stand-in router accepts the request and never serves it; the
stream hub and `RouterBackend` are the real ones."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest
import ray

from deployments.cluster.messages import SubmitResult
from deployments.frontend.router_client import RouterBackend
from deployments.frontend.stream_hub import StreamHub
from engine import SamplingParams
from helpers import local_ray, wait_for

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@ray.remote(num_cpus=0)
class StuckRouter:
    """Admits every request, then nothing happens to it (every worker is wedged)."""

    def __init__(self):
        self.submitted, self.aborted = [], []

    def submit(self, req):
        self.submitted.append(req.request_id)
        return SubmitResult(True)

    def abort(self, request_id):
        self.aborted.append(request_id)

    def calls(self):
        return self.submitted, self.aborted


@pytest.fixture(scope="module")
def cluster():
    with local_ray(1, namespace="pdserve-deadline-test"):
        yield


def test_request_without_progress_ends_with_an_error(cluster):
    router, hub = StuckRouter.remote(), StreamHub()
    backend = RouterBackend(router, hub, "hub-deadline", request_timeout_s=1.5)

    async def go():
        return [d async for d in backend.generate("stuck", [1, 2, 3], SamplingParams(max_tokens=4))]

    t0 = time.monotonic()
    deltas = asyncio.run(go())
    took = time.monotonic() - t0
    assert len(deltas) == 1 and deltas[0].finished and deltas[0].finish_reason == "error"
    assert "no progress" in deltas[0].error and "request_timeout_s" in deltas[0].error
    assert 1.5 <= took < 10.0
    # The abort is fire-and-forget: wait for it to land.
    submitted, aborted = wait_for(lambda: ray.get(router.calls.remote(), timeout=30), lambda calls: calls[1],
                                  timeout_s=10, what="the router's abort")
    assert submitted == ["stuck"] and aborted == ["stuck"]
