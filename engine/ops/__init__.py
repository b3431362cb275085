"""The per-token ops of a decoder layer behind one interface, with one implementation per device family.

    torch   the reference: plain torch ops, attention by gathering blocks + SDPA (any device)
    cpu     our compiled C kernels (engine/cpu_kernels.py): fused per-token ops, paged decode attention
    triton  Triton kernels (engine/triton_kernels/): one paged attention launch for prefill, decode and
            speculative rows, fused add+RMSNorm, RoPE with the KV store, SiLU x mul (CUDA; on a CPU only
            under TRITON_INTERPRET=1, which the tests use)

The model (engine/models/) calls these; the model runner builds each step's metadata through `plan`.
A backend is chosen by name (`EngineConfig.ops_backend`) or by `default_backend` for the device.
"""

from __future__ import annotations

import os

import torch

from engine.config import OPS_BACKENDS
from engine.errors import EngineConfigError
from engine.ops.base import Ops, RopeTables, StepPlan



def default_backend(device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype) -> str:
    """What `auto` means on `device`: Triton on CUDA (when importable), the C kernels on a CPU where they
    build (fp32 math), the torch reference elsewhere."""
    from engine import cpu_kernels

    if device.type == "cuda":
        return "triton" if _triton_available() else "torch"
    if device.type == "cpu" and cpu_kernels.available(device, dtype, kv_dtype):
        return "cpu"
    return "torch"


def _triton_available() -> bool:
    try:
        from engine import triton_kernels
    except ImportError:
        return False
    return triton_kernels.available()


def make_ops(name: str, device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype) -> Ops:
    """The backend `name` (one of OPS_BACKENDS) for a model computing in `dtype` over a `kv_dtype` cache."""
    name = os.environ.get("PDSERVE_OPS_BACKEND") or name
    if name == "auto":
        name = default_backend(device, dtype, kv_dtype)
    if name == "torch":
        from engine.ops.torch_ops import TorchOps
        return TorchOps()
    if name == "cpu":
        from engine import cpu_kernels
        from engine.ops.cpu_ops import CpuOps
        if not cpu_kernels.available(device, dtype, kv_dtype):
            raise EngineConfigError(f"ops_backend='cpu' needs a CPU device, float32 math and a C compiler "
                                    f"(got device={device}, dtype={dtype}); use auto or torch")
        return CpuOps()
    if name == "triton":
        from engine.ops.triton_ops import TritonOps
        if not _triton_available():
            raise EngineConfigError("ops_backend='triton' needs triton and a CUDA device (or TRITON_INTERPRET=1 "
                                    "on a CPU, for tests); use auto or torch")
        return TritonOps()
    raise EngineConfigError(f"ops_backend={name!r}: choose one of {', '.join(OPS_BACKENDS)}")


__all__ = ["OPS_BACKENDS", "Ops", "RopeTables", "StepPlan", "default_backend", "make_ops"]
