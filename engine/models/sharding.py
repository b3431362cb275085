"""Tensor-parallel shards of a Llama-family decoder: which heads, columns and vocab rows rank r of W holds.

    q heads       rank r: [r*H/W, (r+1)*H/W)                                  (H % W == 0)
    KV heads      KVH >= W: [r*KVH/W, (r+1)*KVH/W)                            (KVH % W == 0)
                  KVH <  W: the one head its q heads group to, r*KVH // W     (W % KVH == 0; replicated)
    qkv, gate|up  column-parallel: the rows of its heads / its slice of the intermediate size
    o, down       row-parallel: the matching input columns; the bias on rank 0 only; one all-reduce each
    embedding     vocab-parallel: rows [r*Vp/W, (r+1)*Vp/W) of the vocab padded to Vp (a multiple of W);
                  a token outside the slice looks up zeros, one all-reduce sums the ranks' rows
    lm_head       vocab-parallel: the same rows; the logits' slices are gathered on rank 0 only

Weights are sliced from the loaded HF modules (copies), and the HF modules' projection weights are then
released: each rank holds its shard only (besides the small replicated norms and rotary tables).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from engine.errors import EngineConfigError


class ShardLayout(NamedTuple):
    """Rank `rank` of `world`'s share of a model with `num_heads` q heads and `num_kv_heads` KV heads."""

    rank: int
    world: int
    head0: int  # first q head of this rank
    num_heads: int  # q heads on this rank
    kv_head0: int  # first KV head of this rank
    num_kv_heads: int  # KV heads on this rank (1 when replicated)

    @classmethod
    def of(cls, hf_cfg, world: int, rank: int) -> ShardLayout:
        heads, kv_heads = check_tp_shapes(hf_cfg, world)
        nh = heads // world
        if kv_heads >= world:
            nkv = kv_heads // world
            return cls(rank, world, rank * nh, nh, rank * nkv, nkv)
        return cls(rank, world, rank * nh, nh, rank * kv_heads // world, 1)


def check_tp_shapes(hf_cfg, world: int) -> tuple[int, int]:
    """(q heads, KV heads) of `hf_cfg` once `world` ranks can split them; EngineConfigError naming the
    field otherwise."""
    heads = hf_cfg.num_attention_heads
    kv_heads = getattr(hf_cfg, "num_key_value_heads", None) or heads
    if world == 1:
        return heads, kv_heads
    if heads % world:
        raise EngineConfigError(f"tensor_parallel_size={world} must divide the model's num_attention_heads={heads}")
    if kv_heads % world and world % kv_heads:
        raise EngineConfigError(f"tensor_parallel_size={world} must divide the model's num_key_value_heads="
                                f"{kv_heads} or be a multiple of it (then each KV head is replicated)")
    inter = getattr(hf_cfg, "intermediate_size", None)
    if inter is not None and inter % world:
        raise EngineConfigError(f"tensor_parallel_size={world} must divide the model's intermediate_size={inter}")
    return heads, kv_heads


def local_kv_heads(hf_cfg, world: int) -> int:
    """KV heads one rank's cache holds."""
    _, kv_heads = check_tp_shapes(hf_cfg, world)
    return kv_heads if world == 1 else max(kv_heads // world, 1)


def vocab_slice(vocab_size: int, world: int, rank: int) -> tuple[int, int]:
    """(first row, rows per rank) of rank `rank`'s slice of the vocab padded to a multiple of `world`."""
    per = -(-vocab_size // world)
    return rank * per, per


def padded_rows(weight: torch.Tensor, lo: int, n: int) -> torch.Tensor:
    """Rows [lo, lo + n) of `weight` (a copy), zeros past its end (the vocab's padding)."""
    out = torch.zeros(n, *weight.shape[1:], dtype=weight.dtype, device=weight.device)
    hi = min(lo + n, weight.shape[0])
    if hi > lo:
        out[:hi - lo] = weight[lo:hi]
    return out


def release(*modules) -> None:
    """Free the HF modules' weights and biases (the shard keeps its own copies)."""
    for m in modules:
        for name in ("weight", "bias"):
            p = getattr(m, name, None)
            if isinstance(p, torch.Tensor):
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)


class VocabParallelEmbedding:
    """This rank's rows of the embedding; `__call__(ids)` -> [T, hidden], summed over the ranks."""

    def __init__(self, weight: torch.Tensor, vocab_size: int, tp):
        self.lo, per = vocab_slice(vocab_size, tp.world, tp.rank)
        self.weight = padded_rows(weight.detach(), self.lo, per)
        self.tp = tp

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.lo
        outside = (local < 0) | (local >= self.weight.shape[0])
        # NOTE: exact: each token's row is a sum of its own row and zeros.
        h = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(h)


class ShardedWeights(NamedTuple):
    """One rank's linear weights, per layer: (weight, bias) pairs."""

    qkv: list[tuple[torch.Tensor, torch.Tensor | None]]
    o: list[tuple[torch.Tensor, torch.Tensor | None]]
    gate_up: list[tuple[torch.Tensor, torch.Tensor | None]]
    down: list[tuple[torch.Tensor, torch.Tensor | None]]
    head: tuple[torch.Tensor, torch.Tensor | None]


def _cat_bias(parts: list[torch.Tensor | None], sizes: list[int], like: torch.Tensor) -> torch.Tensor | None:
    if all(p is None for p in parts):
        return None
    return torch.cat([p if p is not None else torch.zeros(n, dtype=like.dtype, device=like.device)
                      for p, n in zip(parts, sizes)]).contiguous()


@torch.no_grad()
def shard_weights(layers, lm_head, layout: ShardLayout, head_dim: int, vocab_size: int) -> ShardedWeights:
    """Slice every layer's projections and the lm_head for `layout`'s rank, then release the HF copies."""
    r, W, D = layout.rank, layout.world, head_dim
    q0, q1 = layout.head0 * D, (layout.head0 + layout.num_heads) * D
    k0, k1 = layout.kv_head0 * D, (layout.kv_head0 + layout.num_kv_heads) * D
    qkv, o, gate_up, down = [], [], [], []
    for layer in layers:
        a, m = layer.self_attn, layer.mlp
        w = torch.cat([a.q_proj.weight[q0:q1], a.k_proj.weight[k0:k1], a.v_proj.weight[k0:k1]]).contiguous()
        b = _cat_bias([None if p.bias is None else p.bias[s0:s1] for p, (s0, s1) in
                       ((a.q_proj, (q0, q1)), (a.k_proj, (k0, k1)), (a.v_proj, (k0, k1)))],
                      [q1 - q0, k1 - k0, k1 - k0], w)
        qkv.append((w, b))
        o.append((a.o_proj.weight[:, q0:q1].contiguous(),
                  None if a.o_proj.bias is None or r else a.o_proj.bias.clone()))
        n = m.gate_proj.weight.shape[0] // W
        i0, i1 = r * n, (r + 1) * n
        gu = torch.cat([m.gate_proj.weight[i0:i1], m.up_proj.weight[i0:i1]]).contiguous()
        gu_b = _cat_bias([None if p.bias is None else p.bias[i0:i1] for p in (m.gate_proj, m.up_proj)], [n, n], gu)
        gate_up.append((gu, gu_b))
        down.append((m.down_proj.weight[:, i0:i1].contiguous(),
                     None if m.down_proj.bias is None or r else m.down_proj.bias.clone()))
        release(a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj)
    lo, per = vocab_slice(vocab_size, W, r)
    hb = getattr(lm_head, "bias", None)
    head = (padded_rows(lm_head.weight, lo, per), None if hb is None else padded_rows(hb, lo, per))
    return ShardedWeights(qkv, o, gate_up, down, head)
