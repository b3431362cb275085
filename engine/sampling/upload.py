"""Host tensors of any dtype moved to the device in one transfer (the sampler's per-step inputs).

NOTE: as in engine/step_inputs.py, on CUDA the tensors are packed into one pinned host buffer and
copied with `non_blocking=True`: the host never waits for the device here, and one copy replaces
one per tensor. Each piece starts on an 8-byte boundary, so the device views of it (`view(dtype)`)
are aligned. On a CPU the host tensors are the device tensors: there is nothing to copy.
"""

from __future__ import annotations

import torch

_ALIGN = 8


class HostBatch:
    """Usage: `i = batch.add(tensor)`, ..., `tensors = batch.upload(device)`, then `tensors[i]`."""

    __slots__ = ("_tensors",)

    def __init__(self) -> None:
        self._tensors: list[torch.Tensor] = []

    def add(self, tensor: torch.Tensor) -> int:
        """Queue a host tensor (any shape, any non-bool dtype); returns its index in `upload`'s result."""
        assert tensor.device.type == "cpu" and tensor.dtype != torch.bool
        self._tensors.append(tensor.contiguous())
        return len(self._tensors) - 1

    def upload(self, device: torch.device) -> list[torch.Tensor]:
        if device.type != "cuda" or not self._tensors:
            return [t.to(device) for t in self._tensors]
        sizes = [t.numel() * t.element_size() for t in self._tensors]
        offsets, total = [], 0
        for n in sizes:
            offsets.append(total)
            total += -(-n // _ALIGN) * _ALIGN
        host = torch.empty(max(total, _ALIGN), dtype=torch.uint8, pin_memory=True)
        for t, off, n in zip(self._tensors, offsets, sizes):
            if n:
                host[off:off + n].copy_(t.view(-1).view(torch.uint8))
        dev = host.to(device, non_blocking=True)
        return [dev[off:off + n].view(t.dtype).view(t.shape) for t, off, n in zip(self._tensors, offsets, sizes)]
