"""Whether an error means this process's device is unusable, so the process should exit.

Some CUDA errors are sticky: after an illegal memory access, a device-side assert, a launch failure
and a few more, every later CUDA call in the process fails with the same error, and only a new
process gets a working context. A serving worker that catches such an error and carries on fails
every step while looking alive; it should exit instead, so its supervisor (Ray, for a worker actor)
starts a fresh process and its requests move elsewhere. Other errors (out of memory, a bad request's
shapes) leave the context usable and must not end the process.

The engine never exits by itself; its caller asks `is_device_fatal(exc, device)` when a step raises.
"""

from __future__ import annotations

import torch

# cudaError_t values that corrupt the context (CUDA runtime API docs: "the process must be terminated
# and relaunched"): launch timeout, illegal address, device-side assert, hardware stack error, illegal
# instruction, misaligned address, invalid address space, invalid PC, launch failure; ECC uncorrectable.
STICKY_CUDA_ERROR_CODES = frozenset({700, 702, 710, 714, 715, 716, 717, 718, 719, 214})
# The same errors as torch, CuPy and NCCL word them (lowercase substrings).
STICKY_CUDA_ERROR_TEXTS = (
    "illegal memory access", "device-side assert", "unspecified launch failure", "misaligned address",
    "illegal instruction", "uncorrectable ecc error", "launch timed out", "hardware stack error",
    "invalid program counter", "operation not supported on global/shared address space",
    "cudaerrorillegaladdress", "cudaerrorassert", "cudaerrorlaunchfailure",
)
# Errors that may or may not have broken the context: the device is probed to tell.
_CUDA_ERROR_HINTS = ("cuda error", "cudaerror", "cuda driver error", "unhandled cuda error", "cublas_status_execution_failed")


def _chain(exc: BaseException):
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def device_healthy(device: torch.device | str) -> bool:
    """Whether `device` still runs work: waits for it, then runs and reads one tiny kernel."""
    device = torch.device(device)
    if device.type != "cuda":
        return True
    try:
        torch.cuda.synchronize(device)
        return int(torch.ones(1, device=device).add_(1).item()) == 2
    except Exception:  # noqa: BLE001 - any failure here means the context is gone
        return False


def is_device_fatal(exc: BaseException, device: torch.device | str | None = None) -> bool:
    """True when `exc` (or an error it was raised from) says this process's CUDA context is broken.

    Sticky CUDA errors are recognised by their code or wording; other CUDA errors, when `device` is
    given, by probing the device (`device_healthy`). Out-of-memory and non-CUDA errors are never
    fatal: the process can go on serving."""
    maybe = False
    for e in _chain(exc):
        if isinstance(e, torch.cuda.OutOfMemoryError):
            return False
        if getattr(e, "error_code", None) in STICKY_CUDA_ERROR_CODES:
            return True
        text = str(e).lower()
        if any(m in text for m in STICKY_CUDA_ERROR_TEXTS):
            return True
        maybe = maybe or isinstance(e, getattr(torch, "AcceleratorError", ())) or any(h in text for h in _CUDA_ERROR_HINTS)
    if maybe and device is not None and torch.device(device).type == "cuda":
        return not device_healthy(device)
    return False
