"""StreamHub: one poll for all of a consumer's streams, reads acknowledged (a lost poll loses nothing),
consumers isolated, events put in offset order."""

from __future__ import annotations

import time

import pytest
import ray

from deployments.cluster.messages import StreamEvent
from deployments.frontend.stream_hub import StreamHub


@pytest.fixture(scope="module")
def hub():
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, namespace="pdserve-hub")
    yield StreamHub.remote()
    ray.shutdown()


def _ids(batch):
    return {rid: [t for ev in evs for t in ev.token_ids] for rid, evs in batch.items()}


def test_unacknowledged_events_are_served_again_and_consumers_are_isolated(hub):
    ray.get([hub.open.remote("a", "c1"), hub.open.remote("b", "c1"), hub.open.remote("x", "c2")])
    hub.push.remote([StreamEvent("a", 0, [1, 2]), StreamEvent("b", 0, [7]), StreamEvent("x", 0, [9])])
    batch, last = ray.get(hub.next_all.remote("c1", 0, 5.0))
    assert _ids(batch) == {"a": [1, 2], "b": [7]} and last > 0
    # The caller of that poll "went away": the same ack gets the same events again.
    again, last2 = ray.get(hub.next_all.remote("c1", 0, 5.0))
    assert _ids(again) == _ids(batch) and last2 == last
    # Acknowledged events are gone; an event that arrives early waits for the one it follows.
    hub.push.remote([StreamEvent("a", 3, [4], finished=True, finish_reason="length")])
    hub.push.remote([StreamEvent("a", 2, [3])])
    batch, last3 = ray.get(hub.next_all.remote("c1", last, 5.0))
    assert _ids(batch) == {"a": [3, 4]} and batch["a"][-1].finished
    # Nothing new: the poll times out empty, and the finished, acknowledged stream is dropped.
    assert ray.get(hub.next_all.remote("c1", last3, 0.2)) == ({}, last3)
    assert ray.get(hub.delivered.remote("a")) is None
    assert ray.get(hub.delivered.remote("b")) == [7]
    # The other consumer's stream was never touched by c1's polls.
    other, _ = ray.get(hub.next_all.remote("c2", 0, 5.0))
    assert _ids(other) == {"x": [9]}


def test_nothing_stays_behind():
    """Closed streams ignore late pushes; a finished stream nobody acknowledges is dropped after
    `done_ttl_s`; an unfinished one stays (it may be queued for long) until it is closed."""
    hub = StreamHub.remote(done_ttl_s=0.3)
    ray.get([hub.open.remote(rid, "c") for rid in ("done", "live", "closed")])
    ray.get(hub.close.remote("closed"))
    ray.get(hub.push.remote([StreamEvent("done", 0, [1], finished=True, finish_reason="length"),
                             StreamEvent("live", 0, [2]), StreamEvent("closed", 0, [3])]))
    assert ray.get(hub.num_streams.remote()) == 2
    assert ray.get(hub.delivered.remote("closed")) is None
    # The consumer never polls again (its client went away, its poller ended).
    deadline = time.monotonic() + 10
    while ray.get(hub.num_streams.remote()) != 1:
        assert time.monotonic() < deadline, "the finished, unacknowledged stream was never dropped"
        time.sleep(0.2)
    assert ray.get(hub.delivered.remote("live")) == [2]
    ray.get(hub.close.remote("live"))
    assert ray.get(hub.num_streams.remote()) == 0
