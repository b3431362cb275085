"""`is_device_fatal`: which errors mean the process's CUDA context is gone (the worker must exit)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from engine.device_health import device_healthy, is_device_fatal


@pytest.mark.parametrize("message", [
    "CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be asynchronously reported",
    "CUDA error: device-side assert triggered",
    "CUDA error: unspecified launch failure",
    "CUDA error: misaligned address",
    "cudaErrorIllegalAddress: an illegal memory access was encountered",
])
def test_sticky_cuda_errors_are_fatal(message):
    assert is_device_fatal(RuntimeError(message))
    assert is_device_fatal(torch.AcceleratorError(message))


def test_fatal_error_found_behind_a_wrapping_one():
    try:
        try:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        except RuntimeError as inner:
            raise ValueError("step failed") from inner
    except ValueError as outer:
        assert is_device_fatal(outer)


@pytest.mark.parametrize("exc", [
    torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"),
    RuntimeError("shape '[4, -1]' is invalid for input of size 7"),
    ValueError("no token has a finite probability"),
    KeyError("r1"),
])
def test_other_errors_are_not(exc):
    assert not is_device_fatal(exc)
    assert not is_device_fatal(exc, device="cpu")


def test_a_cpu_device_is_always_healthy():
    assert device_healthy("cpu")
    # An unclear CUDA error on a CPU engine: nothing to probe, not fatal.
    assert not is_device_fatal(RuntimeError("CUDA error: unknown error"), device="cpu")


@pytest.mark.gpu
def test_real_device_side_assert_is_fatal_and_oom_is_not():
    """In a child process (a device-side assert ruins the context of the process it happens in)."""
    code = textwrap.dedent("""
        import torch
        from engine.device_health import device_healthy, is_device_fatal
        try:
            torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
        except Exception as exc:
            print("oom", is_device_fatal(exc, "cuda"), device_healthy("cuda"))
        try:
            x = torch.zeros(4, device="cuda")
            x[torch.tensor([10], device="cuda")] = 1.0
            torch.cuda.synchronize()
        except Exception as exc:
            print("assert", is_device_fatal(exc, "cuda"), device_healthy("cuda"))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    lines = out.stdout.split("\n")
    assert "oom False True" in lines, out.stdout + out.stderr
    assert "assert True False" in lines, out.stdout + out.stderr
