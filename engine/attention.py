"""Attention over packed variable-length batches, reading paged KV through block tables.

On CPU this gathers a sequence's blocks and calls torch SDPA; a GPU build can swap in a paged kernel
behind the same `AttentionMetadata`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillSeq:
    start: int  # row of the first new token in the packed batch
    end: int
    num_computed: int  # tokens already in the KV cache before this chunk
    block_table: torch.Tensor  # [num_blocks] int64


@dataclass(slots=True)
class AttentionMetadata:
    """Built by the model runner once per step; read by every layer."""

    slot_mapping: torch.Tensor  # [T] flat slot of each new token: block * block_size + offset
    # Single-token rows (decode), attended in one padded SDPA call.
    decode_rows: torch.Tensor | None  # [Bd] packed-row index of each decode token
    decode_block_tables: torch.Tensor | None  # [Bd, max_blocks] (padded with block 0)
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, max_blocks * block_size] True = attend
    # Multi-token chunks (prefill), one SDPA call each.
    prefills: list[PrefillSeq]


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k_cache: [num_blocks, block_size, kv_heads, head_dim]; k: [T, kv_heads, head_dim]."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, heads, head_dim]; k, v: this step's new keys/values [T, kv_heads, head_dim] (already
    written to the cache). Returns [T, heads, head_dim]."""
    out = torch.empty_like(q)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if meta.decode_rows is not None:
        bt = meta.decode_block_tables
        bd = bt.shape[0]
        keys = k_cache[bt].view(bd, -1, num_kv_heads, head_dim).transpose(1, 2)
        values = v_cache[bt].view(bd, -1, num_kv_heads, head_dim).transpose(1, 2)
        qd = q[meta.decode_rows].unsqueeze(2)  # [Bd, heads, 1, head_dim]
        o = F.scaled_dot_product_attention(qd, keys, values, attn_mask=meta.decode_mask, scale=scale,
                                           enable_gqa=True)
        out[meta.decode_rows] = o.squeeze(2)
    for p in meta.prefills:
        qs = q[p.start:p.end].transpose(0, 1).unsqueeze(0)  # [1, heads, n, head_dim]
        n = p.end - p.start
        if p.num_computed == 0:
            ks = k[p.start:p.end].transpose(0, 1).unsqueeze(0)
            vs = v[p.start:p.end].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
        else:
            ctx = p.num_computed + n
            ks = k_cache[p.block_table].view(-1, num_kv_heads, head_dim)[:ctx].transpose(0, 1).unsqueeze(0)
            vs = v_cache[p.block_table].view(-1, num_kv_heads, head_dim)[:ctx].transpose(0, 1).unsqueeze(0)
            qpos = torch.arange(p.num_computed, ctx, device=q.device).unsqueeze(1)
            mask = torch.arange(ctx, device=q.device).unsqueeze(0) <= qpos  # [n, ctx]
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)
        out[p.start:p.end] = o.squeeze(0).transpose(0, 1)
    return out
