"""The Triton backend (CUDA; a CPU under TRITON_INTERPRET=1): one paged attention launch for every row
of a step, RoPE with the KV store, fused add+RMSNorm and SiLU x mul (engine/triton_kernels)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.ops.base import HostStep, Ops, RopeTables, StepPlan
from engine.step_inputs import StepInputs


@dataclass(slots=True)
class TritonMeta:
    """One step's attention metadata for `unified_attention` (also the static buffers of a CUDA graph)."""

    slot_mapping: torch.Tensor  # [T] int64 block * block_size + offset of each new token; < 0: padding row
    block_tables: torch.Tensor  # [num_seqs, W] block ids per sequence (chunk), padded
    seq_lens: torch.Tensor  # [num_seqs] context length with this step's tokens
    query_start_loc: torch.Tensor  # [num_seqs + 1] first packed row of each sequence
    max_query_len: int  # the launch grid's query tiles: fixed per CUDA graph


def triton_arrays(hs: HostStep, block_size: int, width: int | None = None) -> tuple[list[int], list[int], list[int], list[int], int]:
    """(slot_mapping, flat block tables [S * W], seq_lens, query_start_loc, W) as host lists."""
    slots = [b * block_size + p % block_size for b, p in zip(hs.slot_blocks, hs.positions)]
    used = [-(-n // block_size) for n in hs.seq_lens]
    w = width or max(used, default=1) or 1
    flat: list[int] = []
    for table, n in zip(hs.seq_tables, used):
        flat.extend(table[:n])
        flat.extend([0] * (w - n))
    qsl = [0]
    for n in hs.seq_query_lens:
        qsl.append(qsl[-1] + n)
    return slots, flat, list(hs.seq_lens), qsl, w


class TritonOps(Ops):
    name = "triton"

    def __init__(self) -> None:
        from engine import triton_kernels
        self.k = triton_kernels

    def plan(self, hs: HostStep, inputs: StepInputs, block_size: int) -> StepPlan:
        slots, flat, lens, qsl, w = triton_arrays(hs, block_size)
        keys = [inputs.add(a) for a in (slots, flat, lens, qsl)]
        max_q = max(hs.seq_query_lens, default=1)

        def build(t: list[torch.Tensor]) -> TritonMeta:
            s, f, n, q = (t[k] for k in keys)
            return TritonMeta(s, f.view(-1, w).to(torch.int32), n.to(torch.int32), q.to(torch.int32), max_q)
        return build

    def rope_inputs(self, rotary_emb, hidden, positions, cos_sin_cache) -> RopeTables:
        return RopeTables(None, None, positions, cos_sin_cache)

    def add_rmsnorm(self, h, delta, norm, out_dtype):
        x = self.k.add_rmsnorm(h, delta, norm.weight, norm.variance_epsilon)
        return h, x if out_dtype is None or out_dtype == x.dtype else x.to(out_dtype)

    def qkv_store(self, qkv, attn, rope, k_cache, v_cache, meta: TritonMeta, num_heads, num_kv_heads, head_dim):
        T = qkv.shape[0]
        nq, nkv = num_heads * head_dim, num_kv_heads * head_dim
        if hasattr(attn, "q_norm"):  # Qwen3 norms q and k per head before the rotation: in place, then fused
            qkv[:, :nq] = attn.q_norm(qkv[:, :nq].view(T, num_heads, head_dim)).reshape(T, nq)
            qkv[:, nq:nq + nkv] = attn.k_norm(qkv[:, nq:nq + nkv].view(T, num_kv_heads, head_dim)).reshape(T, nkv)
        q = torch.empty(T, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
        self.k.rope_store(qkv, q, rope.cos_sin_cache, rope.positions, k_cache, v_cache, meta.slot_mapping, num_heads)
        k = qkv[:, nq:nq + nkv].view(T, num_kv_heads, head_dim)
        v = qkv[:, nq + nkv:].view(T, num_kv_heads, head_dim)
        return q, k, v

    def attention(self, q, k, v, k_cache, v_cache, meta: TritonMeta, scale, workspace, prefill_dtype):
        out = torch.empty_like(q)
        self.k.unified_attention(q, k_cache, v_cache, out, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                 meta.max_query_len, scale)
        return out

    def silu_mul(self, gate_up, act_fn):
        return self.k.silu_mul(gate_up)
