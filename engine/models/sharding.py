"""Tensor-parallel shards of a Llama-family decoder: which heads, columns and vocab rows rank r of W holds.

    q heads       rank r: [r*H/W, (r+1)*H/W)                                  (H % W == 0)
    KV heads      KVH >= W: [r*KVH/W, (r+1)*KVH/W)                            (KVH % W == 0)
                  KVH <  W: the one head its q heads group to, r*KVH // W     (W % KVH == 0; replicated)
    qkv, gate|up  column-parallel: the rows of its heads / its slice of the intermediate size
    o, down       row-parallel: the matching input columns; the bias on rank 0 only; one all-reduce each
    embedding     vocab-parallel: rows [r*Vp/W, (r+1)*Vp/W) of the vocab padded to Vp (a multiple of W);
                  a token outside the slice looks up zeros, one all-reduce sums the ranks' rows
    lm_head       vocab-parallel: the same rows; the logits' slices are gathered on rank 0 only

Slices are read by parameter name from a tensor source (engine/models/checkpoint.py): the checkpoint's
safetensors files, memory-mapped, so a rank reads only its slices; or, where the checkpoint is not in
that form, the HF modules loaded whole, whose projection weights are released once sliced.
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


def padded_rows(src, name: str, lo: int, n: int, vocab_size: int, like: torch.Tensor | None = None) -> torch.Tensor:
    """Rows [lo, lo + n) of tensor `name` (its first dim is the vocab), zeros past the vocab (padding)."""
    hi = min(lo + n, vocab_size)
    part = src.get(name, rows=(lo, hi)) if hi > lo else None
    ref = part if part is not None else like
    out = torch.zeros(n, *ref.shape[1:], dtype=ref.dtype, device=ref.device)
    if part is not None:
        out[:hi - lo] = part
    return out


def release(*modules) -> None:
    """Free the HF modules' weights and biases (the shard keeps its own copies)."""
    for m in modules:
        for name in ("weight", "bias"):
            p = getattr(m, name, None)
            if isinstance(p, torch.Tensor):
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)


class VocabParallelEmbedding:
    """This rank's rows of the embedding (`weight`: [Vp / W, hidden], zeros for the padding);
    `__call__(ids)` -> [T, hidden], summed over the ranks."""

    def __init__(self, weight: torch.Tensor, vocab_size: int, tp):
        self.lo, _ = vocab_slice(vocab_size, tp.world, tp.rank)
        self.weight = weight
        self.tp = tp

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.lo
        outside = (local < 0) | (local >= self.weight.shape[0])
        # NOTE: exact: each token's row is a sum of its own row and zeros.
        h = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(h)


Pair = tuple[torch.Tensor, torch.Tensor | None]


class ShardedWeights(NamedTuple):
    """One rank's weights: per layer (weight, bias) pairs, the embedding's and the lm_head's rows."""

    qkv: list[Pair]
    o: list[Pair]
    gate_up: list[Pair]
    down: list[Pair]
    embed: torch.Tensor
    head: Pair


def _cat_bias(parts: list[torch.Tensor | None], sizes: list[int], like: torch.Tensor) -> torch.Tensor | None:
    """The fused projection's bias (zeros for a part without one), or None when no part has one."""
    if all(p is None for p in parts):
        return None
    return torch.cat([p if p is not None else torch.zeros(n, dtype=like.dtype, device=like.device)
                      for p, n in zip(parts, sizes)]).contiguous()


@torch.no_grad()
def shard_weights(src, hf_cfg, layout: ShardLayout, head_dim: int) -> ShardedWeights:
    """Rank `layout.rank`'s slices, read from `src` (engine/models/checkpoint.py: the loaded HF modules,
    or the checkpoint's safetensors files, memory-mapped) by the checkpoint's parameter names."""
    r, W, D = layout.rank, layout.world, head_dim
    q = (layout.head0 * D, (layout.head0 + layout.num_heads) * D)
    kv = (layout.kv_head0 * D, (layout.kv_head0 + layout.num_kv_heads) * D)
    n = hf_cfg.intermediate_size // W
    inter = (r * n, (r + 1) * n)
    qkv, o, gate_up, down = [], [], [], []
    for i in range(hf_cfg.num_hidden_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        parts = [(a + "q_proj", q), (a + "k_proj", kv), (a + "v_proj", kv)]
        w = torch.cat([src.get(p + ".weight", rows=rows) for p, rows in parts]).contiguous()
        qkv.append((w, _cat_bias([src.get(p + ".bias", rows=rows) if src.has(p + ".bias") else None
                                  for p, rows in parts], [q[1] - q[0], kv[1] - kv[0], kv[1] - kv[0]], w)))
        o.append((src.get(a + "o_proj.weight", cols=q).contiguous(),
                  src.get(a + "o_proj.bias") if src.has(a + "o_proj.bias") and r == 0 else None))
        gu_parts = [m + "gate_proj", m + "up_proj"]
        gu = torch.cat([src.get(p + ".weight", rows=inter) for p in gu_parts]).contiguous()
        gate_up.append((gu, _cat_bias([src.get(p + ".bias", rows=inter) if src.has(p + ".bias") else None
                                       for p in gu_parts], [n, n], gu)))
        down.append((src.get(m + "down_proj.weight", cols=inter).contiguous(),
                     src.get(m + "down_proj.bias") if src.has(m + "down_proj.bias") and r == 0 else None))
    V = hf_cfg.vocab_size
    lo, per = vocab_slice(V, W, r)
    embed = padded_rows(src, "model.embed_tokens.weight", lo, per, V)
    tied = getattr(hf_cfg, "tie_word_embeddings", False) or not src.has("lm_head.weight")
    head = embed if tied else padded_rows(src, "lm_head.weight", lo, per, V, embed)
    head_b = padded_rows(src, "lm_head.bias", lo, per, V, embed[:, 0]) if src.has("lm_head.bias") else None
    return ShardedWeights(qkv, o, gate_up, down, embed, (head, head_b))
