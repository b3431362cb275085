"""What rank 0 hands the followers of its tensor-parallel group (pickled through the group's store)."""

from __future__ import annotations

from typing import NamedTuple

from engine.ops.base import HostStep


class StepMessage(NamedTuple):
    """Run this step's forward on your shard (`ModelRunner.run_eager`)."""

    host_step: HostStep


class ShutdownMessage(NamedTuple):
    """Rank 0 is closing: leave the loop."""


class KVGatherMessage(NamedTuple):
    """Send your slice of these blocks' KV heads to rank 0 (`engine.parallel.kv_shards`)."""

    block_ids: tuple[int, ...]


class KVScatterMessage(NamedTuple):
    """Receive your slice of these blocks' KV heads from rank 0 and write it into your cache."""

    block_ids: tuple[int, ...]
