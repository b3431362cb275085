"""What rank 0 hands the followers of its tensor-parallel group (pickled through the group's store)."""

from __future__ import annotations

from typing import NamedTuple

from engine.ops.base import HostStep


class StepMessage(NamedTuple):
    """Run this step's forward on your shard (`ModelRunner.run_eager`)."""

    host_step: HostStep


class ShutdownMessage(NamedTuple):
    """Rank 0 is closing: leave the loop."""
