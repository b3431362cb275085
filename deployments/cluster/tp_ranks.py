"""A tensor-parallel worker's ranks on Ray: one placement group per worker, rank 0 the worker actor,
ranks 1..N-1 `TPFollower` actors it starts (engine.parallel.worker.run_follower in each).

    router                                 worker actor = rank 0 (bundle 0)
    placement_group([bundle] * N,          leader_store(N, node ip) -> init_method
        STRICT_PACK, detached, named       TPFollower x (N-1), bundles 1..N-1 ── run(init_method) ──┐
        after the worker)                  TPGroup.connect(0)  ◀─────────── gloo / NCCL group ──────┘
    Worker.options(bundle 0)               LLMEngine(config, tp_group)   (scheduler, sampler, KV lending)
    worker dead / drained / shut down:     a follower's run() ends or its step fails -> os._exit(1):
        ray.kill(worker); remove the group     the router sees the worker die, as any worker death

The router, placement, migration, autoscaling and draining see one worker: only `_start_worker`
(where the group is made) and the places that kill a worker (where it is removed) know the ranks.
The followers are owned by the worker actor (not detached): Ray ends them when it ends, and removing
the placement group ends every actor in it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import replace
from typing import Any

import ray
from ray.util.placement_group import get_current_placement_group, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from deployments.config import ServeConfig
from engine import EngineConfig
from engine.parallel import TPGroup, leader_store
from engine.parallel.worker import join_watching

logger = logging.getLogger(__name__)

GROUP_TIMEOUT_S = 120.0  # the rendezvous, each collective, and the followers' model load against rank 0's
WATCH_EVERY_S = 1.0


def placement_group_name(worker_id: str) -> str:
    return f"{worker_id}-tp"


def bundles(config: ServeConfig, role: str, resources: dict[str, float]) -> list[dict[str, float]]:
    """One bundle per rank: the worker's CPUs and GPUs each; the role's custom resources (which pin
    it to a node type) in rank 0's bundle only, as a TP-1 worker asks for them once."""
    one = {k: v for k, v in (("CPU", config.worker_num_cpus), ("GPU", config.worker_num_gpus)) if v > 0}
    return [{**one, **resources}] + [dict(one) for _ in range(config.tp_size(role) - 1)]


def create_placement_group(worker_id: str, config: ServeConfig, role: str, resources: dict[str, float]) -> Any:
    """The worker's group, or None for a TP-1 worker (it is placed as before). Detached and named after
    the worker: it outlives a router restart with its worker, and any router removes it by name."""
    if config.tp_size(role) == 1:
        return None
    return placement_group(bundles(config, role, resources), strategy="STRICT_PACK",
                           name=placement_group_name(worker_id), lifetime="detached")


def remove_worker_placement_group(worker_id: str) -> bool:
    """Remove the worker's group (ending every actor still in it); False if it has none."""
    try:
        pg = ray.util.get_placement_group(placement_group_name(worker_id))
    except ValueError:
        return False
    try:
        remove_placement_group(pg)
    except Exception:  # noqa: BLE001 - removed meanwhile
        logger.debug("removing %s's placement group", worker_id, exc_info=True)
    return True


def scheduling(pg: Any, bundle: int) -> dict[str, Any]:
    return {} if pg is None else {"scheduling_strategy": PlacementGroupSchedulingStrategy(pg, bundle)}


@ray.remote(max_restarts=0, max_concurrency=2)
class TPFollower:
    """Rank r > 0 of a worker: its shard and KV heads; runs the steps rank 0 hands it (`run`, which
    lasts as long as the worker; `ping` answers beside it)."""

    def ping(self) -> int:
        return os.getpid()

    def run(self, config: EngineConfig, rank: int, world: int, init_method: str, timeout_s: float) -> str:
        from engine.parallel import run_follower

        logging.basicConfig(level=os.environ.get("PDSERVE_LOG_LEVEL", "WARNING"))
        # NOTE: a short poll: the follower notices rank 0's store closing at once anyway; this bounds
        # how long a wait runs before it is renewed.
        return run_follower(config, rank, world, init_method, timeout_s, poll_s=5.0)


class Ranks:
    """Rank 0's followers: started in its placement group, watched, and stopped with it."""

    def __init__(self, worker_id: str, config: EngineConfig, num_cpus: float, num_gpus: float):
        world = config.tensor_parallel_size
        assert world > 1
        self.worker_id = worker_id
        pg = get_current_placement_group()
        if pg is None:
            raise RuntimeError(f"{worker_id}: tensor_parallel_size={world} but the worker is not in a placement group")
        host = ray.util.get_node_ip_address()
        store, init_method = leader_store(world, host, GROUP_TIMEOUT_S)
        # A Ray actor sees its one GPU as cuda:0 (engine.parallel.worker.rank_device).
        follower_config = replace(config, device="cuda:0") if config.device == "cuda" else config
        self.actors = [TPFollower.options(num_cpus=num_cpus, num_gpus=num_gpus, **scheduling(pg, r))
                       .remote() for r in range(1, world)]
        self.runs = [a.run.remote(follower_config, r, world, init_method, GROUP_TIMEOUT_S)
                     for r, a in enumerate(self.actors, start=1)]
        self.closing = False
        try:
            self.group = self._join(lambda: TPGroup.connect(0, world, init_method, config.device, GROUP_TIMEOUT_S,
                                                            store=store))
        except BaseException:
            self.kill()
            raise
        threading.Thread(target=self._watch, name=f"{worker_id}-tp-watch", daemon=True).start()

    def _join(self, join):
        """The rendezvous, failing at once if a follower ends first (its model or device failed)."""
        def gone() -> str | None:
            done, _ = ray.wait(self.runs, num_returns=1, timeout=0)
            return f"{self.worker_id}: a rank ended ({self._why(done[0])})" if done else None

        return join_watching(join, gone, name=f"{self.worker_id}-tp-join")

    @staticmethod
    def _why(ref) -> str:
        try:
            return f"it returned {ray.get(ref, timeout=5)!r}"
        except Exception as e:  # noqa: BLE001 - what killed it
            return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"

    def _watch(self) -> None:
        """A follower whose run() ends while rank 0 is serving (its process died, its step failed):
        the worker cannot step any more. Exit, so the router sees this worker die and moves its work,
        as it does for any worker death (the followers owned by this process end with it)."""
        while not self.closing:
            done, _ = ray.wait(self.runs, num_returns=1, timeout=WATCH_EVERY_S)
            if done and not self.closing:
                logger.critical("%s: tensor-parallel rank %d ended (%s); the worker exits so its requests move",
                                self.worker_id, self.runs.index(done[0]) + 1, self._why(done[0]))
                os._exit(1)

    def kill(self) -> None:
        """End the followers (the worker closes, or its engine failed to start); not a failure."""
        self.closing = True
        for a in self.actors:
            try:
                ray.kill(a)
            except Exception:  # noqa: BLE001 - already gone
                pass


def exit_on_failed_step(worker_id: str, exc: BaseException) -> None:
    """A tensor-parallel worker's step failed: its ranks may be out of step (a rank died mid-step, a
    collective timed out), so it cannot go on. Exit: the router moves its requests elsewhere."""
    logger.critical("%s: a tensor-parallel step failed (%s: %s); exiting so the work moves elsewhere",
                    worker_id, type(exc).__name__, exc)
    time.sleep(0.1)  # the log line out first
    os._exit(1)
