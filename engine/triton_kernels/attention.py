"""Paged attention for every kind of row in one Triton launch (two for split K/V, below): prefill chunks
(with or without cached context), decode rows and speculative-verify rows, causal, GQA, over the
block-major KV cache.

One program handles one tile of BLOCK_Q query rows of one sequence for one KV head. Its M dimension
(the rows of `tl.dot`) is BLOCK_Q tokens x the KV head's group of query heads (padded to a power of
two), so each K/V tile is loaded once for the whole group. K/V tiles of BLOCK_N context tokens are
gathered through the block table and folded in with an online softmax in fp32.

Programs are numbered over the packed query rows (vLLM's layout, our code): sequence s owns program
ids from `query_start_loc[s] // BLOCK_Q + s` on, one per tile of its rows, so there are at most
`T // BLOCK_Q + num_seqs` of them and each finds its sequence by a binary search on the device.
Split K/V (flash decoding): a batch whose sequences' rows each fit one query tile (decode and verify
rows, short chunks), with too few (sequence, KV head) pairs to fill the GPU, gives each pair NUM_SPLITS
programs, one per share of the context; a second kernel merges their partial softmax states. The context's length is read on the device, so the shares are
too: a short context leaves most of them empty (they cost an early pass and a merge launch).

NOTE: the grids are functions of (T, num_seqs, max_query_len, num_kv_heads, num_heads) only, never of
the lengths' values: a CUDA graph captured at a padded batch replays for any real lengths.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.triton_kernels.fused_ops import check_kv_cache, e5m2_to_f32, interpreted, kv_pointer, round_to

# Rows of `tl.dot` (query tokens x heads of a group) per program: decode/verify batches and prefill.
DECODE_BLOCK_M = 16
PREFILL_BLOCK_M = 64
BLOCK_N = 64  # context tokens per K/V tile (any multiple of 16; need not divide the cache's block size)
NUM_WARPS = 4
NUM_STAGES = 2
# Split K/V when (sequences x KV heads) is below TARGET_PROGRAMS (about 2 per SM of an H100/H200), into
# at most MAX_SPLITS shares (a power of two; 1 turns splitting off).
TARGET_PROGRAMS = 256
MAX_SPLITS = 16
_LOG2E = 1.4426950408889634


@triton.jit
def _find_seq(qsl_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """The last sequence s whose first program id (`qsl[s] // BLOCK_Q + s`) is <= tile."""
    lo: tl.int32 = 0
    hi = num_seqs  # half-open: the answer is in [lo - 1, hi)
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(qsl_ptr + mid) // BLOCK_Q + mid <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _load_kv(ptr, mask, KV_FP8: tl.constexpr, DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    """A K/V tile as the dot's operand: the cache's values rounded to DTYPE (q's), as the engine's
    torch path rounds them (`k_cache.to(q.dtype)`); fp32 copies of those values when emulating."""
    if KV_FP8:
        x = e5m2_to_f32(tl.load(ptr, mask=mask, other=0))
    else:
        x = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    x = round_to(x, DTYPE, EMULATE)
    if EMULATE:
        x = x.to(tl.float32)
    return x


@triton.jit
def _dot(a, b, DTYPE: tl.constexpr):
    # fp32 inputs: full fp32 products (TF32 would lose the precision an fp32 engine is run for).
    if DTYPE == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _attend_tile(q, m_i, l_i, acc, start, kv_end, q_pos, scale_log2, table, k_ptr, v_ptr, kvh, stride_kb, stride_ks,
                 stride_kh, stride_vb, stride_vs, stride_vh, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_N: tl.constexpr, Q_DTYPE: tl.constexpr, KV_FP8: tl.constexpr, EMULATE: tl.constexpr):
    """Fold the K/V tile of context tokens start .. start + BLOCK_N - 1 into the online softmax. `q` is in
    the dot's dtype (Q_DTYPE, or fp32 holding Q_DTYPE's values when emulating)."""
    key = start + tl.arange(0, BLOCK_N)
    key_ok = key < kv_end
    offs_d = tl.arange(0, HEAD_DIM)
    blk = tl.load(table + key // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
    slot = key % BLOCK_SIZE
    k_off = blk * stride_kb + slot * stride_ks + kvh * stride_kh
    k = _load_kv(k_ptr + k_off[None, :] + offs_d[:, None], key_ok[None, :], KV_FP8, Q_DTYPE, EMULATE)
    s = _dot(q, k, q.dtype) * scale_log2
    s = tl.where((key[None, :] <= q_pos[:, None]) & key_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v_off = blk * stride_vb + slot * stride_vs + kvh * stride_vh
    v = _load_kv(v_ptr + v_off[:, None] + offs_d[None, :], key_ok[:, None], KV_FP8, Q_DTYPE, EMULATE)
    p = round_to(p, Q_DTYPE, EMULATE).to(q.dtype)  # the probabilities enter the product in q's dtype
    acc = acc * alpha[:, None] + _dot(p, v, q.dtype)
    return m_new, l_i, acc


@triton.jit
def _unified_attention_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, part_ptr, ml_ptr, tables_ptr, seq_lens_ptr, qsl_ptr, num_seqs, num_rows,
        num_heads, scale_log2, stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh,
        stride_vb, stride_vs, stride_vh, stride_bt,
        BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, KV_FP8: tl.constexpr,
        EMULATE: tl.constexpr):
    Q_DTYPE: tl.constexpr = q_ptr.dtype.element_ty
    MMA_DTYPE: tl.constexpr = tl.float32 if EMULATE else Q_DTYPE
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = _find_seq(qsl_ptr, num_seqs, tile, BLOCK_Q)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    q_tile = tile - (q_start // BLOCK_Q + seq)
    if q_tile * BLOCK_Q >= q_len:  # past this sequence's rows (or a padding sequence: q_len 0)
        return
    ctx = tl.load(seq_lens_ptr + seq) - q_len  # tokens cached before this step's rows

    offs_m = tl.arange(0, BLOCK_M)
    tok = q_tile * BLOCK_Q + offs_m // GROUP_PAD  # query row within the sequence
    member = offs_m % GROUP_PAD
    row_ok = (tok < q_len) & (member < GROUP)
    head = kvh * GROUP + member
    q_pos = ctx + tok  # row i attends keys 0 .. its position
    rows = (q_start + tok).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None], other=0.0).to(MMA_DTYPE)

    # NOTE: m starts finite, so rows with every key masked so far (padding rows of the tile, rows whose
    # causal end is behind this K/V tile) keep alpha = 1 and p = 0 instead of NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    kv_end = ctx + tl.minimum(q_len, (q_tile + 1) * BLOCK_Q)  # keys the tile's last row needs
    table = tables_ptr + seq.to(tl.int64) * stride_bt
    kv_lo = 0
    kv_hi = kv_end
    if NUM_SPLITS > 1:  # this program's share: whole K/V tiles, so only the last tile is ragged
        share = tl.cdiv(tl.cdiv(kv_end, BLOCK_N), NUM_SPLITS) * BLOCK_N
        kv_lo = tl.program_id(2) * share
        kv_hi = tl.minimum(kv_lo + share, kv_end)
    if EMULATE:  # the interpreter cannot take a tensor as range()'s bound (numpy 2 refuses int() of it)
        start = kv_lo
        while start < kv_hi:
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, start, kv_end, q_pos, scale_log2, table, k_ptr, v_ptr, kvh, stride_kb, stride_ks,
                stride_kh, stride_vb, stride_vs, stride_vh, BLOCK_SIZE, HEAD_DIM, BLOCK_N, Q_DTYPE, KV_FP8, EMULATE)
            start += BLOCK_N
    else:
        for start in range(kv_lo, kv_hi, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, start, kv_end, q_pos, scale_log2, table, k_ptr, v_ptr, kvh, stride_kb, stride_ks,
                stride_kh, stride_vb, stride_vs, stride_vh, BLOCK_SIZE, HEAD_DIM, BLOCK_N, Q_DTYPE, KV_FP8, EMULATE)

    if NUM_SPLITS == 1:
        out = acc / l_i[:, None]
        out_rows = rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptr + out_rows, round_to(out, out_ptr.dtype.element_ty, EMULATE), mask=row_ok[:, None])
    else:  # NOTE: every split writes its state, an empty share too (m = -1e30, l = 0): the merge reads all
        part = (tl.program_id(2) * num_rows + rows) * num_heads + head
        tl.store(part_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_ok[:, None])
        tl.store(ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(ml_ptr + part * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _merge_splits_kernel(part_ptr, ml_ptr, out_ptr, qsl_ptr, num_seqs, num_rows, num_heads, stride_ot, stride_oh,
                         NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, EMULATE: tl.constexpr):
    """One (row, head): the softmax states of its K/V shares, rescaled to a common max and summed."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    if row >= tl.load(qsl_ptr + num_seqs):  # a padding row: never written
        return
    part = (tl.arange(0, NUM_SPLITS) * num_rows + row).to(tl.int64) * num_heads + head
    m = tl.load(ml_ptr + part * 2)
    w = tl.exp2(m - tl.max(m, axis=0))
    l = tl.sum(tl.load(ml_ptr + part * 2 + 1) * w, axis=0)
    d = tl.arange(0, HEAD_DIM)
    acc = tl.sum(tl.load(part_ptr + part[:, None] * HEAD_DIM + d[None, :]) * w[:, None], axis=0)
    out = out_ptr + row.to(tl.int64) * stride_ot + head * stride_oh + d
    tl.store(out, round_to(acc / l, out_ptr.dtype.element_ty, EMULATE))


def tile_config(num_heads: int, num_kv_heads: int, max_query_len: int) -> tuple[int, int]:
    """(GROUP_PAD, BLOCK_Q): the group of query heads per KV head padded to a power of two, and the
    query tokens per program (at least 1; BLOCK_Q x GROUP_PAD >= 16, what `tl.dot` needs)."""
    group_pad = triton.next_power_of_2(num_heads // num_kv_heads)
    block_m = DECODE_BLOCK_M if max_query_len * group_pad <= DECODE_BLOCK_M else PREFILL_BLOCK_M
    return group_pad, max(block_m, group_pad) // group_pad


def split_count(num_seqs: int, num_kv_heads: int, max_query_len: int, block_q: int) -> int:
    """K/V shares per (sequence, KV head): 1 unless every sequence's rows fit one query tile (decode and
    verify batches, short chunks) and the pairs are too few to fill the GPU."""
    n = TARGET_PROGRAMS // (num_seqs * num_kv_heads)
    if MAX_SPLITS <= 1 or max_query_len > block_q or n < 2:
        return 1
    return min(MAX_SPLITS, 1 << (n.bit_length() - 1))


def unified_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                      block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                      max_query_len: int, scale: float) -> None:
    """Causal attention of the packed query rows over the paged cache, written into `out`.

    q, out: [T, heads, head_dim] (fp32/bf16/fp16; head_dim contiguous); out in q's dtype. Rows past
    `query_start_loc[-1]` (padding) are not written. k_cache, v_cache: one layer's views of the cache,
    [num_blocks, block_size, kv_heads, head_dim] (dims 1-3 contiguous, dim 0 any stride), fp32, bf16,
    fp16 or fp8 e5m2. block_tables: [num_seqs, W] int32 (row stride free). seq_lens: [num_seqs] int32,
    context length with this step's rows (their K/V already stored). query_start_loc: [num_seqs + 1]
    int32, cumulative query rows. Row i of sequence s sits at position `seq_lens[s] - q_len + i`.
    `max_query_len`: an upper bound of the q_lens (a host int: it picks the tiles, reads nothing).

    Math: scores and softmax in fp32; the two products take q's dtype (K/V rounded to it, as the
    engine's torch path rounds them; the probabilities too, as flash attention does). Decode/verify
    batches of few sequences split the context (`split_count`): a second launch and fp32 scratch of
    splits x T x heads x (head_dim + 2), allocated here (from the graph's pool under CUDA-graph capture)."""
    check_kv_cache(k_cache, v_cache)
    T, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, hd = k_cache.shape
    assert hd == head_dim, f"q's head_dim {head_dim} != the cache's {hd}"
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, f"head_dim must be a power of two >= 16 (got {head_dim})"
    assert num_heads % num_kv_heads == 0, f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
    assert q.dtype in (torch.float32, torch.bfloat16, torch.float16) and q.stride(2) == 1, "q: float, head_dim contiguous"
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1, f"out must be like q ({q.dtype})"
    num_seqs = block_tables.shape[0]
    assert block_tables.dtype == torch.int32 and block_tables.stride(1) == 1, "block_tables: [num_seqs, W] int32"
    assert seq_lens.dtype == torch.int32 and seq_lens.shape == (num_seqs,), f"seq_lens: [{num_seqs}] int32"
    assert query_start_loc.dtype == torch.int32 and query_start_loc.shape == (num_seqs + 1,), \
        f"query_start_loc: [{num_seqs + 1}] int32"
    if num_seqs == 0 or T == 0:
        return
    group_pad, block_q = tile_config(num_heads, num_kv_heads, max(1, max_query_len))
    kc, vc = kv_pointer(k_cache), kv_pointer(v_cache)
    qsl = query_start_loc.contiguous()
    splits = split_count(num_seqs, num_kv_heads, max(1, max_query_len), block_q)
    part = ml = out  # unused without splits
    if splits > 1:  # each split's unnormalised output, and its (max, sum) of the softmax
        part = torch.empty(splits, T, num_heads, head_dim, dtype=torch.float32, device=q.device)
        ml = torch.empty(splits, T, num_heads, 2, dtype=torch.float32, device=q.device)
    grid = (T // block_q + num_seqs, num_kv_heads, splits)
    _unified_attention_kernel[grid](
        q, kc, vc, out, part, ml, block_tables, seq_lens.contiguous(), qsl, num_seqs, T, num_heads,
        float(scale) * _LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2), block_tables.stride(0),
        BLOCK_SIZE=block_size, GROUP=num_heads // num_kv_heads, GROUP_PAD=group_pad, HEAD_DIM=head_dim,
        BLOCK_Q=block_q, BLOCK_N=BLOCK_N, NUM_SPLITS=splits, KV_FP8=k_cache.dtype == torch.float8_e5m2,
        EMULATE=interpreted(_unified_attention_kernel), num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    if splits > 1:
        _merge_splits_kernel[(T, num_heads)](part, ml, out, qsl, num_seqs, T, num_heads, out.stride(0), out.stride(1),
                                             NUM_SPLITS=splits, HEAD_DIM=head_dim,
                                             EMULATE=interpreted(_merge_splits_kernel), num_warps=4)
