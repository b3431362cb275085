"""Which transport a KV cache gets: the top of kv_transfer's imports (it knows every backend, none knows it).

Importing kv_transfer.nccl needs no GPU: cupy loads only when a channel opens.
"""

from __future__ import annotations

import torch

from kv_transfer.gloo import GlooTransport
from kv_transfer.nccl import NcclTransport
from kv_transfer.transport import Transport


def make_transport(device: torch.device | str, host: str, timeout_s: float = 30.0) -> Transport:
    """The transport for a KV cache on `device`: NCCL for CUDA tensors, gloo for CPU tensors.

    `host` is this node's address as peers reach it (gloo binds its store there; NCCL ignores it).
    """
    device = torch.device(device)
    if device.type == "cuda":
        return NcclTransport(device, timeout_s)
    if device.type == "cpu":
        return GlooTransport(host, timeout_s)
    raise ValueError(f"no KV transport for device type {device.type!r} (cpu: gloo, cuda: nccl)")
