"""Triton kernels of the GPU engine: paged attention for every kind of row (`attention`) and the
fused per-token ops (`fused_ops`). They also run on a CPU under TRITON_INTERPRET=1 (how the tests
check them), slowly.

Importing this package never imports triton (CI machines may lack it): the kernels' modules load on
first use of a name below, and `available()` says whether they can run here.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Any

_EXPORTS = {"unified_attention": "attention", "add_rmsnorm": "fused_ops", "rope_store": "fused_ops",
            "silu_mul": "fused_ops"}
__all__ = ["available", *_EXPORTS]


def available() -> bool:
    """Whether the kernels run here: triton imports, and there is a CUDA device or TRITON_INTERPRET=1."""
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken install counts as missing
        return False
    if os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on"):
        return True
    import torch

    return torch.cuda.is_available()


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value  # later lookups skip this hook
    return value
