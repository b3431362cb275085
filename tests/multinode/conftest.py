"""The multi-node tests' fixture: a bed of Ray hosts in network namespaces, joined by this process."""

from __future__ import annotations

from typing import Any, Callable, Iterator

import pytest

from helpers import wait_for
from netbed import RAY_NAMESPACE, NetBed, alive_nodes, bed_unavailable, disconnect, netns_cluster



@pytest.fixture(scope="module")
def make_bed() -> Iterator[Callable[..., Any]]:
    """Factory: make_bed(head, others, env) -> a started NetBed with this process joined to its Ray
    cluster (one bed per module). At the end: Serve and pdserve's router shut down, Ray disconnected,
    the bed torn down, whatever happened before."""
    why = bed_unavailable()
    if why:
        pytest.skip(why)
    netns_cluster.teardown_orphans()  # beds left by a run that was killed before its teardown
    beds: list[Any] = []
    saved_env: list[dict] = []

    def make(head: Any, others: list[Any], env: dict[str, str] | None = None) -> Any:
        import ray

        bed = NetBed(env=env)
        beds.append(bed)
        bed.start(head, others)
        # The bed's auth settings, read again by Ray: the tests before this module may have started a
        # local Ray in this process, whose settings Ray keeps (netns_cluster_ops.use_driver_env).
        old = netns_cluster.use_driver_env(bed.driver_env())
        saved_env.append(saved_env[0] if saved_env else old)
        ray.init(**bed.ray_init_kwargs(), namespace=RAY_NAMESPACE, log_to_driver=False)
        wait_for(lambda: len(alive_nodes()), lambda n: n == len(others) + 2, timeout_s=60, what="every host joined")
        return bed

    yield make
    disconnect()
    if saved_env:
        netns_cluster.use_driver_env(saved_env[0])  # the tests after this module see what they saw before
    for bed in beds:
        bed.teardown()
        left = netns_cluster.leftovers(bed.id)
        assert not any(left.values()), f"bed {bed.id} not fully torn down: {left}"


