"""The reference backend: plain torch ops; attention gathers blocks into a workspace and runs SDPA."""

from __future__ import annotations

import torch

from engine.attention import (AttentionMetadata, PrefillSeq, decode_bucket, paged_attention, paged_decode_meta,
                              plan_decode_buckets, write_kv)
from engine.ops.base import HostStep, Ops, RopeTables, StepPlan
from engine.step_inputs import StepInputs


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class TorchOps(Ops):
    name = "torch"
    fused = False  # the model calls the fused add+RMSNorm / SiLU x mul only where a backend has them
    paged_decode = False  # CpuOps: decode rows through the compiled kernel

    def plan(self, hs: HostStep, inputs: StepInputs, block_size: int) -> StepPlan:
        k_slots = inputs.add(hs.slot_blocks)
        k_pos = inputs.add(hs.positions)
        k_tables = [inputs.add(table) for *_, table in hs.prefills]
        paged, plans = None, []
        if hs.decode_rows and self.paged_decode:  # the CPU kernel's own int32 metadata
            paged = paged_decode_meta(hs.decode_rows, hs.decode_tables, hs.decode_lens, block_size)
        elif hs.decode_rows:
            plans = plan_decode_buckets(hs.decode_rows, hs.decode_tables, hs.decode_lens, block_size)
        k_buckets = [(inputs.add(p.rows), inputs.add(p.blocks), None if p.lens is None else inputs.add(p.lens))
                     for p in plans]

        def build(t: list[torch.Tensor]) -> AttentionMetadata:
            return AttentionMetadata(
                slot_blocks=t[k_slots],
                slot_offsets=t[k_pos] % block_size,
                decode=[decode_bucket(p, t[r], t[b], None if n is None else t[n], block_size)
                        for p, (r, b, n) in zip(plans, k_buckets)],
                prefills=[PrefillSeq(r0, r1, start, t[k]) for (r0, r1, start, _), k in zip(hs.prefills, k_tables)],
                paged=paged)
        return build

    def rope_inputs(self, rotary_emb, hidden, positions, cos_sin_cache) -> RopeTables:
        cos, sin = rotary_emb(hidden.unsqueeze(0), positions.unsqueeze(0))
        return RopeTables(cos[0].contiguous(), sin[0].contiguous(), positions)

    def add_rmsnorm(self, h, delta, norm, out_dtype):
        if delta is not None:
            h = h + delta
        x = norm(h)
        return h, x if out_dtype is None else x.to(out_dtype)

    def qkv_store(self, qkv, attn, rope, k_cache, v_cache, meta, num_heads, num_kv_heads, head_dim):
        T = qkv.shape[0]
        nq, nkv = num_heads * head_dim, num_kv_heads * head_dim
        q = qkv[:, :nq].view(T, num_heads, head_dim)
        k = qkv[:, nq:nq + nkv].reshape(T, num_kv_heads, head_dim)
        v = qkv[:, nq + nkv:].reshape(T, num_kv_heads, head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3
            q, k = attn.q_norm(q), attn.k_norm(k)
        cos, sin = rope.cos.unsqueeze(1), rope.sin.unsqueeze(1)  # [T, 1, head_dim]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        write_kv(k_cache, v_cache, k, v, meta)
        return q, k, v

    def attention(self, q, k, v, k_cache, v_cache, meta, scale, workspace, prefill_dtype):
        return paged_attention(q, k, v, k_cache, v_cache, meta, scale, workspace, prefill_dtype)
