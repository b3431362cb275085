"""The integer inputs of one step (token ids, positions, slots, block tables...), moved to the device
in one transfer.

NOTE: on CUDA, `torch.tensor(values, device="cuda")` copies from pageable memory, which blocks the
host until the device has run everything queued before it: one such copy per input made every step
wait for the previous step's kernels. Here the arrays are packed into one pinned host tensor and
copied with `non_blocking=True`, so the host goes on building the step while the copy and the
earlier kernels run. The pinned block goes back to torch's caching host allocator when the step
drops it, and the allocator reuses it only after the copy that reads it has finished.
On a CPU each array becomes its own tensor, as before: there is no copy to save.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import torch


class StepInputs:
    """Collects int64 arrays for one step; `upload` returns them on the device, in the order added.

    Usage: `i = inputs.add(ids)`, ..., `tensors = inputs.upload(device)`, then `tensors[i]`.
    """

    __slots__ = ("_arrays",)

    def __init__(self) -> None:
        self._arrays: list[Sequence[int]] = []

    def add(self, values: Sequence[int]) -> int:
        """Queue one array; returns its index in `upload`'s result."""
        self._arrays.append(values)
        return len(self._arrays) - 1

    def upload(self, device: torch.device) -> list[torch.Tensor]:
        """The queued arrays as int64 tensors on `device` (views of one buffer)."""
        if device.type != "cuda":  # nothing to copy: one tensor per array is the cheapest (no split)
            return [torch.tensor(a, dtype=torch.long, device=device) for a in self._arrays]
        sizes = [len(a) for a in self._arrays]
        host = torch.tensor(list(itertools.chain.from_iterable(self._arrays)), dtype=torch.long, pin_memory=True)
        return list(torch.split(host.to(device, non_blocking=True), sizes)) if sizes else []


def upload_ints(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """One int64 array on `device`, through the same non-blocking path."""
    inputs = StepInputs()
    inputs.add(values)
    return inputs.upload(device)[0]
