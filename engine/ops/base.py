"""The interface every ops backend implements, and the backend-neutral description of one step."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from engine.step_inputs import StepInputs


class PromptSpan(NamedTuple):
    """Rows row0 .. row0 + len(target_ids) - 1 of a chunk of a request that asked for prompt_logprobs:
    each one's logits score the prompt token after it."""

    chunk_index: int
    row0: int
    target_ids: list[int]
    k: int


class HostStep(NamedTuple):
    """One step's inputs as host lists, before they go to the device. Rows are packed chunk after
    chunk (`sched.chunks` order); `seq_*` describe every chunk, `decode_*` / `prefills` split them the
    way the gather + SDPA path attends them."""

    input_ids: list[int]
    positions: list[int]
    slot_blocks: list[int]  # the block each new token's K/V goes to
    sample_rows: list[int]  # packed rows whose logits are sampled
    decode_rows: list[int]  # single-position rows (decode tokens, and each row of a chunk with drafts)
    decode_tables: list[list[int]]
    decode_lens: list[int]  # context length of each decode row, its new token included
    prefills: list[tuple[int, int, int, list[int]]]  # (start row, end row, tokens cached before, block table)
    prompt_spans: list[PromptSpan]  # rows whose logits score the next prompt token (prompt_logprobs)
    seq_query_lens: list[int]  # per chunk: its rows in the packed batch
    seq_lens: list[int]  # per chunk: its context length once this step's tokens are in
    seq_tables: list[list[int]]  # per chunk: its block table (the blocks that context needs)


# What `Ops.plan` returns: called with the uploaded tensors (`StepInputs.upload`), it returns the
# backend's own attention metadata for the step.
StepPlan = Callable[[list[torch.Tensor]], Any]


class RopeTables(NamedTuple):
    """Rotary inputs for one step's rows, in the form the backend asked for (`Ops.rope_inputs`)."""

    cos: torch.Tensor | None  # [T, head_dim] (torch / cpu backends)
    sin: torch.Tensor | None
    positions: torch.Tensor  # [T] int64
    cos_sin_cache: torch.Tensor | None = None  # [max_pos, head_dim] fp32: cos | sin halves (triton)


class Ops:
    """One backend's per-token ops. Subclasses: TorchOps (reference), CpuOps, TritonOps.

    NOTE: `add_rmsnorm` is only called for plain RMSNorms (weight * x * rsqrt(mean x^2 + eps)), and
    `qkv_store` receives the fused q|k|v projection; the model keeps transformers' own modules for
    anything else."""

    name = "base"
    fused = True  # False: the model computes norms and SiLU x mul with transformers' modules

    def plan(self, hs: HostStep, inputs: StepInputs, block_size: int) -> StepPlan:
        """Queue this step's attention arrays on `inputs`; the returned callable builds the metadata
        from the uploaded tensors."""
        raise NotImplementedError

    def rope_inputs(self, rotary_emb, hidden: torch.Tensor, positions: torch.Tensor,
                    cos_sin_cache: torch.Tensor | None) -> RopeTables:
        raise NotImplementedError

    def add_rmsnorm(self, h: torch.Tensor, delta: torch.Tensor | None, norm,
                    out_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream after adding `delta` (None: nothing to add) and its RMSNorm (in
        `out_dtype` when given). May add in place: `h` is always the model's own activation."""
        raise NotImplementedError

    def qkv_store(self, qkv: torch.Tensor, attn, rope: RopeTables, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: Any, num_heads: int, num_kv_heads: int, head_dim: int):
        """Rotary embedding of q and k (Qwen3's q/k norms first) and the KV-cache write of this step's
        tokens. Returns (q [T, heads, head_dim], k, v [T, kv_heads, head_dim])."""
        raise NotImplementedError

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, meta: Any, scale: float, workspace, prefill_dtype) -> torch.Tensor:
        """[T, heads, head_dim] in q's dtype; the step's K/V are in the cache already."""
        raise NotImplementedError

    def silu_mul(self, gate_up: torch.Tensor, act_fn) -> torch.Tensor:
        """`act_fn(gate) * up` for `gate_up` = [T, 2n] (gate, then up)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return act_fn(gate) * up
