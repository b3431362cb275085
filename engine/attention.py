"""Attention over packed variable-length batches, reading paged KV through block tables.

On CPU in fp32, decode tokens go through our compiled kernel (`engine.cpu_kernels`), which reads each
sequence's K and V straight from its blocks, once. Elsewhere (or without a C compiler) decode tokens
are attended in a few length buckets: each bucket gathers its sequences' blocks into a reused
workspace (`KVWorkspace`) and runs one SDPA call with the query heads grouped by KV head, so GQA needs
no copy of the keys per query head. Prefill chunks run one SDPA call each. A GPU build can swap in a
paged kernel behind the same `AttentionMetadata`.

NOTE: on CPU the gather dominated decode: a fresh tensor per layer costs its page faults every time
(~10x the copy itself), and padding every sequence to the longest in the batch gathers up to twice
the KV that is needed. The workspace and the buckets remove both.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine import cpu_kernels
from engine.step_inputs import StepInputs

# Decode sequences are sorted by context length and cut into buckets of at least this many, at most
# DECODE_BUCKETS buckets: padding waste goes down, SDPA calls stay few.
MIN_BUCKET_SEQS = 16
DECODE_BUCKETS = 4

# NOTE: on a Hopper GPU, SDPA prefers cuDNN's attention for 16-bit inputs, and cuDNN builds a graph
# for each new shape (hundreds of ms). Here shapes change from step to step (decode buckets, prefill
# chunks): on the first H200 run a bf16 engine took 2.6x as long per step as an fp32 one (which
# cuDNN does not serve), with cuDNN attention on top of its profile. These kernels need no build.
_CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attention_backends(device: torch.device) -> contextlib.AbstractContextManager:
    """The SDPA kernels a forward pass on `device` may use (entered around the whole pass: the
    setting is process-wide, and entering it per call costs host time)."""
    return sdpa_kernel(_CUDA_SDPA_BACKENDS) if device.type == "cuda" else contextlib.nullcontext()


@dataclass(slots=True)
class PrefillSeq:
    start: int  # row of the first new token in the packed batch
    end: int
    num_computed: int  # tokens already in the KV cache before this chunk
    block_table: torch.Tensor  # [num_blocks] int64


@dataclass(slots=True)
class DecodeBucket:
    """Single-token rows (decode) of similar context length, attended in one SDPA call."""

    rows: torch.Tensor  # [n] packed-row index of each decode token
    blocks: torch.Tensor  # [n * num_blocks] block ids, row-major, padded with block 0
    num_blocks: int  # blocks per sequence after padding
    mask: torch.Tensor | None  # [n, 1, 1, num_blocks * block_size] True = attend; None: attend all


@dataclass(slots=True)
class PagedDecode:
    """All single-token rows (decode) of a step, for the compiled kernel: no buckets, no padding."""

    rows: torch.Tensor | None  # [n] packed-row index of each decode token; None: rows 0..n-1
    tables: torch.Tensor  # [n, max_blocks] int32 block ids (padding never read)
    lens: torch.Tensor  # [n] int32 context length, the new token included


@dataclass(slots=True)
class AttentionMetadata:
    """Built by the model runner once per step; read by every layer."""

    slot_blocks: torch.Tensor  # [T] the block each new token's K/V goes to
    slot_offsets: torch.Tensor  # [T] its offset in that block
    decode: list[DecodeBucket]
    prefills: list[PrefillSeq]  # multi-token chunks, one SDPA call each
    paged: PagedDecode | None = None  # decode rows for the compiled kernel (then `decode` is empty)


def paged_decode_meta(rows: list[int], tables: list[list[int]], lens: list[int], block_size: int) -> PagedDecode:
    """Decode rows (context `lens[i]` tokens in blocks `tables[i]`) for `cpu_kernels.paged_decode`."""
    width = max(-(-n // block_size) for n in lens)
    flat = []
    for t, n in zip(tables, lens):
        used = t[:-(-n // block_size)]
        flat.extend(used)
        flat.extend([0] * (width - len(used)))
    contiguous = rows == list(range(len(rows)))
    return PagedDecode(None if contiguous else torch.tensor(rows, dtype=torch.long),
                       torch.tensor(flat, dtype=torch.int32).view(len(rows), width),
                       torch.tensor(lens, dtype=torch.int32))


class BucketPlan(NamedTuple):
    """One decode bucket as host lists, before its arrays go to the device (`StepInputs`)."""

    rows: list[int]  # packed-row index of each decode token
    blocks: list[int]  # row-major block ids, padded with block 0
    num_blocks: int  # blocks per sequence after padding
    lens: list[int] | None  # context lengths, for the mask; None: every row fills its blocks (no mask)


def plan_decode_buckets(rows: list[int], tables: list[list[int]], lens: list[int], block_size: int) -> list[BucketPlan]:
    """Group decode rows (context `lens[i]` tokens in blocks `tables[i]`) into length buckets."""
    order = sorted(range(len(rows)), key=lambda i: lens[i])
    per = max(MIN_BUCKET_SEQS, -(-len(order) // DECODE_BUCKETS))
    out = []
    for s in range(0, len(order), per):
        idx = order[s:s + per]
        nb = -(-max(lens[i] for i in idx) // block_size)
        flat = []
        for i in idx:
            t = tables[i][:-(-lens[i] // block_size)]
            flat.extend(t)
            flat.extend([0] * (nb - len(t)))
        blens = [lens[i] for i in idx]
        masked = min(blens) < nb * block_size
        out.append(BucketPlan([rows[i] for i in idx], flat, nb, blens if masked else None))
    return out


def decode_bucket(plan: BucketPlan, rows: torch.Tensor, blocks: torch.Tensor, lens: torch.Tensor | None,
                  block_size: int) -> DecodeBucket:
    """`plan` with its arrays on the device (`lens` given iff `plan.lens` is); the mask is built there."""
    mask = None
    if lens is not None:
        mask = (torch.arange(plan.num_blocks * block_size, device=lens.device).unsqueeze(0)
                < lens.unsqueeze(1))[:, None, None, :]
    return DecodeBucket(rows, blocks, plan.num_blocks, mask)


def decode_buckets(rows: list[int], tables: list[list[int]], lens: list[int], block_size: int,
                   device: torch.device) -> list[DecodeBucket]:
    """`plan_decode_buckets`, then each bucket's arrays on `device` (the model runner batches these
    uploads with the rest of its step's inputs instead)."""
    plans = plan_decode_buckets(rows, tables, lens, block_size)
    inputs = StepInputs()
    keys = [(inputs.add(p.rows), inputs.add(p.blocks), None if p.lens is None else inputs.add(p.lens)) for p in plans]
    t = inputs.upload(torch.device(device))
    return [decode_bucket(p, t[r], t[b], None if n is None else t[n], block_size) for p, (r, b, n) in zip(plans, keys)]


def _bytes_if_fp8(t: torch.Tensor) -> torch.Tensor:
    # fp8 caches are moved as bytes: not every device's index kernels take fp8 (the values are the same).
    return t.view(torch.uint8) if t.element_size() == 1 else t


class KVWorkspace:
    """Reused buffers that gathered KV blocks land in (one for keys, one for values), grown as needed."""

    def __init__(self) -> None:
        self._bufs: list[torch.Tensor | None] = [None, None]

    def gather(self, cache: torch.Tensor, block_ids: torch.Tensor, which: int) -> torch.Tensor:
        """`cache[block_ids]` ([n, *block shape]) written into workspace buffer `which`; valid until the
        next gather into the same buffer."""
        flat = _bytes_if_fp8(cache.view(cache.shape[0], -1))
        n, width = block_ids.numel(), flat.shape[1]
        buf = self._bufs[which]
        if buf is None or buf.numel() < n * width or buf.dtype != flat.dtype or buf.device != flat.device:
            buf = torch.empty(max(n * width, 1 << 16), dtype=flat.dtype, device=flat.device)
            self._bufs[which] = buf
        out = buf[:n * width].view(n, width)
        torch.index_select(flat, 0, block_ids, out=out)
        return out.view(cache.dtype).view(n, *cache.shape[1:])


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             meta: AttentionMetadata) -> None:
    """k_cache: [num_blocks, block_size, kv_heads, head_dim] (one layer's view of the cache: blocks
    are strided by the whole block, all layers); k: [T, kv_heads, head_dim], rounded to the cache's
    element type when that is narrower."""
    idx = (meta.slot_blocks, meta.slot_offsets)
    _bytes_if_fp8(k_cache).index_put_(idx, _bytes_if_fp8(k.to(k_cache.dtype)))
    _bytes_if_fp8(v_cache).index_put_(idx, _bytes_if_fp8(v.to(v_cache.dtype)))


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    workspace: KVWorkspace | None = None, prefill_dtype: torch.dtype | None = None) -> torch.Tensor:
    """q: [T, heads, head_dim]; k, v: this step's new keys/values [T, kv_heads, head_dim] (already
    written to the cache). Returns [T, heads, head_dim] in q's dtype.

    `prefill_dtype` (None: q's): the dtype prefill chunks are attended in. The CPU's bf16 path gives
    bf16: its keys and values are bf16 in the cache already, and oneDNN's bf16 products run SDPA
    2.5-2.9x as fast as fp32 at 300-1000-token chunks on an AMX host (the result is rounded where
    HF's bf16 model rounds it; decode attention stays in the fp32 kernel)."""
    ws = workspace or KVWorkspace()
    out = torch.empty_like(q)
    num_heads = q.shape[1]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    group = num_heads // num_kv_heads
    if meta.paged is not None:
        pd = meta.paged
        if pd.rows is None:  # decode rows lead the batch: the kernel writes into `out` in place
            n = pd.lens.numel()
            cpu_kernels.paged_decode(q[:n], out[:n], k_cache, v_cache, pd.tables, pd.lens, scale)
        else:
            od = torch.empty(pd.rows.numel(), num_heads, head_dim, dtype=q.dtype)
            cpu_kernels.paged_decode(q.index_select(0, pd.rows), od, k_cache, v_cache, pd.tables, pd.lens, scale)
            out[pd.rows] = od
    for b in meta.decode:
        n = b.rows.numel()
        ctx = b.num_blocks * k_cache.shape[1]
        keys = ws.gather(k_cache, b.blocks, 0).view(n, ctx, num_kv_heads, head_dim).transpose(1, 2).to(q.dtype)
        values = ws.gather(v_cache, b.blocks, 1).view(n, ctx, num_kv_heads, head_dim).transpose(1, 2).to(q.dtype)
        # HF's GQA: query head h reads KV head h // group, so [heads] -> [kv_heads, group] is a view.
        qd = q[b.rows].view(n, num_kv_heads, group, head_dim)
        o = F.scaled_dot_product_attention(qd, keys, values, attn_mask=b.mask, scale=scale)
        out[b.rows] = o.reshape(n, num_heads, head_dim)
    pdt = prefill_dtype or q.dtype
    for p in meta.prefills:
        qs = q[p.start:p.end].transpose(0, 1).unsqueeze(0).to(pdt)  # [1, heads, n, head_dim]
        n = p.end - p.start
        if p.num_computed == 0:
            ks = k[p.start:p.end].transpose(0, 1).unsqueeze(0)
            vs = v[p.start:p.end].transpose(0, 1).unsqueeze(0)
            if k_cache.dtype != k.dtype:  # a narrower cache: attend to K/V as stored, whatever the chunking
                ks, vs = ks.to(k_cache.dtype), vs.to(v_cache.dtype)
            ks, vs = ks.to(pdt), vs.to(pdt)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
        else:
            ctx = p.num_computed + n
            ks = ws.gather(k_cache, p.block_table, 0).view(-1, num_kv_heads, head_dim)[:ctx].transpose(0, 1).unsqueeze(0)
            vs = ws.gather(v_cache, p.block_table, 1).view(-1, num_kv_heads, head_dim)[:ctx].transpose(0, 1).unsqueeze(0)
            ks, vs = ks.to(pdt), vs.to(pdt)
            qpos = torch.arange(p.num_computed, ctx, device=q.device).unsqueeze(1)
            mask = torch.arange(ctx, device=q.device).unsqueeze(0) <= qpos  # [n, ctx]
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)
        out[p.start:p.end] = o.squeeze(0).transpose(0, 1)
    return out
