"""The CPU backend: our compiled C kernels (engine/cpu_kernels.py) for decode attention and the fused
per-token ops, the reference's torch ops for the rest (prefill attention: SDPA).

`paged_decode` and `fused` switch the two kernel families off one at a time (tests and the engine
benchmark compare each against the torch path)."""

from __future__ import annotations

import torch

from engine import cpu_kernels
from engine.ops.torch_ops import TorchOps


class CpuOps(TorchOps):
    name = "cpu"

    def __init__(self, paged_decode: bool = True, fused: bool = True):
        self.paged_decode = paged_decode
        self.fused = fused

    def add_rmsnorm(self, h, delta, norm, out_dtype):
        if not self.fused:
            return super().add_rmsnorm(h, delta, norm, out_dtype)
        return h, cpu_kernels.add_rmsnorm(h, delta, norm.weight, norm.variance_epsilon, out_dtype or h.dtype)

    def qkv_store(self, qkv, attn, rope, k_cache, v_cache, meta, num_heads, num_kv_heads, head_dim):
        if not self.fused or hasattr(attn, "q_norm") or rope.cos.shape[-1] != head_dim:
            return super().qkv_store(qkv, attn, rope, k_cache, v_cache, meta, num_heads, num_kv_heads, head_dim)
        T = qkv.shape[0]
        nq, nkv = num_heads * head_dim, num_kv_heads * head_dim
        q = torch.empty(T, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
        cpu_kernels.rope_store(qkv, q, rope.cos, rope.sin, k_cache, v_cache, meta.slot_blocks, meta.slot_offsets,
                               num_heads)
        k = qkv[:, nq:nq + nkv].view(T, num_kv_heads, head_dim)
        v = qkv[:, nq + nkv:].view(T, num_kv_heads, head_dim)
        return q, k, v

    def silu_mul(self, gate_up, act_fn):
        if not self.fused:
            return super().silu_mul(gate_up, act_fn)
        return cpu_kernels.silu_mul(gate_up)
