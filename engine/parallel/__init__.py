"""Tensor parallelism: one worker's model split over several ranks (engine/parallel/group.py for the
group and its messages, engine/models/sharding.py for the shard layout, worker.py for the follower loop
and the local launcher). Never imports Ray: a Ray actor per rank calls `run_follower` itself."""

from engine.parallel.group import LeaderGone, TPGroup, leader_store

__all__ = ["LeaderGone", "TPGroup", "launch_local", "leader_store", "run_follower"]


def __getattr__(name: str):
    # NOTE: lazy: worker.py imports the engine, whose model runner imports this package's group.
    if name in ("launch_local", "run_follower"):
        from engine.parallel import worker
        return getattr(worker, name)
    raise AttributeError(name)
