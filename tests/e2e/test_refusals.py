"""A request that cannot start fails at once, an attempt the router gave up on is cancelled on its
worker, a request whose client left is aborted everywhere even when no abort arrives, and a dead
worker's KV channels are closed by its peers. Ray, a tiny random-weight model."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import ray

from deployments.cluster.answers import Outcome, await_answer
from deployments.cluster.messages import Admission, GenRequest
from deployments.config import ServeConfig
from deployments.frontend.router_client import RouterBackend
from deployments.frontend.stream_hub import StreamHub
from engine import SamplingParams
from helpers import local_ray, pdserve_router, wait_for, wait_no_leaks


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    cfg = ServeConfig.from_dict(dict(model=tiny_model_dir("llama"), num_prefill_workers=1, num_decode_workers=1,
                                     kv_cache_memory_mb=16, health_check_timeout_s=5.0, client_check_s=0.5))
    with local_ray(2, namespace="pdserve-refusals"), pdserve_router(cfg, timeout_s=300) as router:
        yield router, RouterBackend(router, StreamHub(), "hub-refusals", request_timeout_s=120)


@ray.remote(max_concurrency=4)
class _SlowWorker:
    """Stands in for a decode worker whose `admit` takes longer than the router waits."""

    def __init__(self):
        self.aborts: list[tuple] = []
        self.ran = False
        self._released = threading.Event()

    def admit(self, *_args) -> Admission:
        self._released.wait(10)
        if ray.get_runtime_context().is_canceled():
            return Admission(True)  # dropped: it never joins the batch
        self.ran = True
        return Admission(True)

    def abort(self, request_id, attempt, in_flight) -> bool:
        self.aborts.append((request_id, attempt, in_flight))
        self._released.set()
        return False

    def state(self) -> tuple[list, bool]:
        return self.aborts, self.ran


def test_giving_up_on_an_admission_cancels_it_on_the_worker(cluster):
    worker = _SlowWorker.remote()
    req = GenRequest("slow", [5, 6], SamplingParams(), "hub", None, attempt=3)
    answer = asyncio.run(await_answer(worker.admit.remote(), worker, req, timeout_s=0.5))
    assert answer.outcome is Outcome.GAVE_UP
    aborts, ran = wait_for(lambda: ray.get(worker.state.remote()), lambda s: s[0], timeout_s=10, what="abort seen")
    assert aborts == [("slow", 3, True)]  # that attempt, which may still be on its way
    time.sleep(0.5)
    assert not ray.get(worker.state.remote())[1], "the abandoned admission ran anyway"


def test_a_request_the_workers_refuse_fails_at_once(cluster):
    router, backend = cluster

    async def run() -> list:
        # NOTE: past the door (which answers 400): the engines refuse a priority under fcfs themselves
        return [d async for d in backend.generate("refused", [5, 6, 7], SamplingParams(max_tokens=4), priority=3)]

    t0 = time.monotonic()
    deltas = asyncio.run(asyncio.wait_for(run(), 60))
    took = time.monotonic() - t0
    assert deltas[-1].finished and deltas[-1].finish_reason == "error" and "priority" in deltas[-1].error
    assert took < 10, f"a refused request waited {took:.1f}s"
    # The stream's error reaches the client before the worker's on_finished reaches the router.
    wait_for(lambda: ray.get(router.stats.remote(), timeout=30),
             lambda s: (s["num_tracked"], s["num_pending_decode"], s["num_unplaced"]) == (0, 0, 0),
             timeout_s=10, what="the router forgets the refused request")
    wait_no_leaks(router)


def _orphans(router) -> int:
    return sum(w["num_orphans"] for w in ray.get(router.check_integrity.remote(), timeout=30).values())


def test_a_request_whose_client_left_unannounced_is_aborted_by_its_worker(cluster):
    """The client's stream is gone from the hub, but no abort reached the router (lost on the way):
    the decode worker finds out by itself (`client_check_s`) and frees the request everywhere."""
    router, backend = cluster
    before = _orphans(router)
    loop = asyncio.new_event_loop()  # NOTE: not asyncio.run, whose shutdown would close the generator
    try:
        gen = backend.generate("unannounced", [5, 6, 7, 8], SamplingParams(max_tokens=1000, ignore_eos=True))
        first = loop.run_until_complete(asyncio.wait_for(gen.__anext__(), 60))
        assert first.token_ids and not first.finished
        backend.hub.close("unannounced")  # the client is gone; the generator never runs its abort
        wait_for(lambda: ray.get(router.stats.remote(), timeout=30), lambda s: s["num_tracked"] == 0,
                 timeout_s=20, what="the router forgets the orphaned request")
        wait_no_leaks(router, timeout_s=20)
        assert _orphans(router) == before + 1
    finally:
        loop.run_until_complete(gen.aclose())
        loop.close()


def test_a_client_gone_during_submit_aborts_its_request(cluster):
    """Cancelled while the router's `submit` is on its way: the request may be queued all the same, and
    the abort that follows frees it (not the worker's client check, which is slower)."""
    router, backend = cluster
    before = _orphans(router)

    async def go() -> None:
        gen = backend.generate("gone-at-submit", [5, 6, 7, 8], SamplingParams(max_tokens=1000, ignore_eos=True))
        task = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0)  # the generator has sent the submit and awaits its answer
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await gen.aclose()

    asyncio.run(go())
    wait_for(lambda: ray.get(router.stats.remote(), timeout=30), lambda s: s["num_tracked"] == 0,
             timeout_s=20, what="the router forgets the abandoned request")
    wait_no_leaks(router, timeout_s=20)
    assert _orphans(router) == before  # the abort did it


def test_an_abort_heard_before_its_submit_drops_that_submit(cluster):
    """Ray need not start one caller's calls to an async actor in order: a client that leaves while its
    submit is on the way can be heard leaving first. The router keeps the id, and the submit that
    follows is dropped: nothing is queued, run or left to the workers' orphan sweep."""
    router, _ = cluster
    before = _orphans(router)
    counters = ray.get(router.stats.remote(), timeout=30)["counters"]
    ray.get(router.abort.remote("heard-first"), timeout=30)
    req = GenRequest("heard-first", [5, 6, 7, 8], SamplingParams(max_tokens=1000, ignore_eos=True), "hub-refusals",
                     None, num_original_prompt_tokens=4)
    res = ray.get(router.submit.remote(req), timeout=30)
    assert not res.accepted and "aborted" in res.reason
    stats = ray.get(router.stats.remote(), timeout=30)
    assert stats["num_tracked"] == 0
    assert stats["counters"]["submitted"] == counters["submitted"]
    assert stats["counters"]["aborted"] == counters["aborted"] + 1
    wait_no_leaks(router, timeout_s=20)
    assert _orphans(router) == before


def test_a_lone_busy_worker_steps_on_the_idle_pools_core_too(cluster):
    """1 prefill + 1 decode worker of one thread each on 2 Ray CPUs (`share_node_cores`): a lone
    request is prefilled while the decode pool idles and decoded while the prefill pool idles, and
    each of those steps runs on both cores."""
    router, backend = cluster

    async def one() -> int:
        n = 0
        async for d in backend.generate("lone", [9] * 40, SamplingParams(max_tokens=8, ignore_eos=True)):
            n += len(d.token_ids)
        return n

    assert asyncio.run(asyncio.wait_for(one(), 120)) == 8
    reports = wait_no_leaks(router)
    assert {w: r["max_step_threads"] for w, r in reports.items()} == {w: 2 for w in reports}


def test_a_dead_decode_workers_channels_are_closed_by_its_peers(cluster):
    router, backend = cluster

    async def one() -> int:  # a transfer opens (or uses) the pair's channels
        n = 0
        async for d in backend.generate("warm", [9] * 20, SamplingParams(max_tokens=3, ignore_eos=True)):
            n += len(d.token_ids)
        return n

    assert asyncio.run(asyncio.wait_for(one(), 120)) == 3
    workers = ray.get(router.workers.remote(), timeout=30)
    (prefill_id, prefill), = [(w, a) for w, a in workers.items() if "prefill" in w]
    (decode_id, decode), = [(w, a) for w, a in workers.items() if "decode" in w]
    assert decode_id in ray.get(prefill.kv_channels.remote(), timeout=30)["export"]
    ray.kill(decode)
    channels = wait_for(lambda: ray.get(prefill.kv_channels.remote(), timeout=30),
                        lambda ch: decode_id not in ch["export"] + ch["import"], timeout_s=30,
                        what=f"{prefill_id}'s channels to dead {decode_id} closed")
    assert decode_id not in channels["export"] + channels["import"]
