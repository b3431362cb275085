"""The small per-token ops of a Llama layer, fused, as Triton kernels (GPU engine; the CPU engine's
twins are in `engine.cpu_kernels`): residual add + RMSNorm, rotary embedding + KV-cache write, SiLU x up.

Each one rounds where HF's modules round in the model's dtype, so a bf16 engine computes what the HF
model computes (bit for bit where the op order allows, see each function). Also home of the rounding
helpers the attention kernel shares (`round_to`, the fp8 e5m2 codec).

NOTE: Triton's interpreter (TRITON_INTERPRET=1, how the tests run on a CPU) truncates fp32 -> bf16
casts and multiplies bf16 operands of `tl.dot` as integers. The kernels take an `EMULATE` flag (set
when they are interpreted) under which bf16 is rounded by bit arithmetic and dots run on fp32 copies
of the same values; on a GPU they use the native conversions (round to nearest even as well).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e5m2)
# Elements per program of silu_mul (a row of the [T, n] output is cut into tiles of this many).
SILU_BLOCK = 1024


def interpreted(kernel) -> bool:
    """Whether `kernel` (a `triton.jit` function) runs in Triton's interpreter (decided when it was
    decorated, by TRITON_INTERPRET)."""
    return type(kernel).__name__ == "InterpretedFunction"


def num_warps_for(width: int) -> int:
    """Warps for a program that holds `width` elements of a row in registers."""
    return 4 if width <= 2048 else 8 if width <= 8192 else 16


@triton.jit
def round_to(x, DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    """fp32 `x` rounded to DTYPE (to nearest, ties to even: torch's `.to`)."""
    if EMULATE and DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)


@triton.jit
def round_f32(x, DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    """fp32 `x` rounded to DTYPE and back to fp32 (the value a torch op in DTYPE would produce)."""
    if DTYPE == tl.float32:
        return x
    else:
        return round_to(x, DTYPE, EMULATE).to(tl.float32)


@triton.jit
def e5m2_to_f32(byte):
    """fp8 e5m2 (as its uint8 bits) to fp32: e5m2 is the top byte of an fp16, so this is exact."""
    return (byte.to(tl.uint16) << 8).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def f32_to_e5m2(x):
    """fp32 -> fp8 e5m2 bits (uint8), rounded exactly as torch's `.to(torch.float8_e5m2)` rounds (c10's
    `fp8e5m2_from_fp32_value`: to nearest even, 65536 and above to inf, NaN to 0x7F)."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    # Normal range: drop 21 mantissa bits with round-to-nearest-even, rebias the exponent 127 -> 15.
    normal = (a - (112 << 23) + 0xFFFFF + ((a >> 21) & 1)) >> 21
    # Below 2^-14: an fp32 add of 128.0 rounds |x| to a multiple of 2^-16 (e5m2's subnormal step).
    sub = (a.to(tl.float32, bitcast=True) + 128.0).to(tl.int32, bitcast=True) - 0x43000000
    big = tl.where(a > 0x7F800000, 0x7F, 0x7C)
    r = tl.where(a >= (143 << 23), big, tl.where(a < (113 << 23), sub, normal))
    return (r | sign).to(tl.uint8)


@triton.jit
def _add_rmsnorm_kernel(h_ptr, d_ptr, w_ptr, y_ptr, eps, N: tl.constexpr, HAS_DELTA: tl.constexpr,
                        BLOCK: tl.constexpr, EMULATE: tl.constexpr):
    H_DTYPE: tl.constexpr = h_ptr.dtype.element_ty
    Y_DTYPE: tl.constexpr = y_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64) * N
    offs = tl.arange(0, BLOCK)
    ok = offs < N
    h = tl.load(h_ptr + row + offs, mask=ok, other=0.0).to(tl.float32)
    if HAS_DELTA:
        d = tl.load(d_ptr + row + offs, mask=ok, other=0.0).to(tl.float32)
        hr = round_to(h + d, H_DTYPE, EMULATE)
        tl.store(h_ptr + row + offs, hr, mask=ok)
        h = hr.to(tl.float32)
    # NOTE: div_rn/sqrt_rn: IEEE-rounded like torch's (Triton's `/` and sqrt are approximate on a GPU).
    var = tl.math.div_rn(tl.sum(h * h, axis=0), tl.full((), N, tl.float32))
    x = h * tl.math.div_rn(1.0, tl.sqrt_rn(var + eps))
    x = round_f32(x, H_DTYPE, EMULATE)  # HF: `weight * x.to(input_dtype)`
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row + offs, round_to(w * x, Y_DTYPE, EMULATE), mask=ok)


def add_rmsnorm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """`h += delta` in place (when `delta` is given; rounded to h's dtype as torch's add rounds), then
    HF LlamaRMSNorm of `h`: `weight * (h * rsqrt(mean(h^2) + eps)).to(h.dtype)`.

    h, delta: [T, n] contiguous, fp32/bf16/fp16. weight: [n]. Returns [T, n] in the promoted dtype of
    weight and h (torch's `weight * x`), written into `out` when given. Rounding: the normalised value
    and the product are rounded where HF rounds; mean(h^2) is summed in another order than torch's
    (fp32), which can move a bf16 result by 1 ulp, rarely."""
    assert h.dim() == 2 and h.is_contiguous() and h.dtype in _FLOAT_DTYPES, "h must be [T, n] contiguous float"
    T, n = h.shape
    assert weight.is_contiguous() and weight.numel() == n, f"weight must have {n} elements (h's width)"
    if delta is not None:
        assert delta.shape == h.shape and delta.is_contiguous(), "delta must be contiguous and shaped like h"
    y_dtype = torch.promote_types(weight.dtype, h.dtype)
    if out is None:
        out = torch.empty(T, n, dtype=y_dtype, device=h.device)
    assert out.shape == h.shape and out.is_contiguous() and out.dtype == y_dtype, \
        f"out must be [T, n] contiguous {y_dtype}"
    if T == 0:
        return out
    block = triton.next_power_of_2(n)
    assert block <= 65536, f"add_rmsnorm holds a row in registers: n={n} is too wide"
    _add_rmsnorm_kernel[(T,)](h, h if delta is None else delta, weight, out, float(eps), N=n, HAS_DELTA=delta is not None,
                              BLOCK=block, EMULATE=interpreted(_add_rmsnorm_kernel), num_warps=num_warps_for(block))
    return out


@triton.jit
def _silu_mul_kernel(x_ptr, y_ptr, N: tl.constexpr, BLOCK: tl.constexpr, EMULATE: tl.constexpr):
    DTYPE: tl.constexpr = y_ptr.dtype.element_ty
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    g = tl.load(x_ptr + t * 2 * N + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + t * 2 * N + N + offs, mask=ok, other=0.0).to(tl.float32)
    s = round_f32(tl.math.div_rn(g, 1.0 + tl.exp(-g)), DTYPE, EMULATE)  # torch's silu, rounded to the dtype
    tl.store(y_ptr + t * N + offs, round_to(s * u, DTYPE, EMULATE), mask=ok)


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`silu(gate) * up` for gate_up = [T, 2n] contiguous (gate, then up), fp32/bf16/fp16; returns [T, n]
    in the same dtype (into `out` when given). As HF in a 16-bit dtype: silu computed in fp32 and
    rounded to the dtype, then the product rounded (exp may differ from torch's by an fp32 ulp, which
    moves silu by 1 ulp of the dtype, rarely, and the product by up to 2)."""
    assert gate_up.dim() == 2 and gate_up.is_contiguous() and gate_up.dtype in _FLOAT_DTYPES, \
        "gate_up must be [T, 2n] contiguous float"
    assert gate_up.shape[1] % 2 == 0, f"gate_up's width ({gate_up.shape[1]}) must be even (gate | up)"
    T, n = gate_up.shape[0], gate_up.shape[1] // 2
    if out is None:
        out = torch.empty(T, n, dtype=gate_up.dtype, device=gate_up.device)
    assert out.shape == (T, n) and out.is_contiguous() and out.dtype == gate_up.dtype, \
        f"out must be [{T}, {n}] contiguous {gate_up.dtype}"
    if T == 0 or n == 0:
        return out
    block = min(SILU_BLOCK, triton.next_power_of_2(n))
    _silu_mul_kernel[(T, triton.cdiv(n, block))](gate_up, out, N=n, BLOCK=block, EMULATE=interpreted(_silu_mul_kernel),
                                                  num_warps=4)
    return out


@triton.jit
def _rope_heads(src, dst, dst_stride, cos, sin, heads, NUM: tl.constexpr, HALF: tl.constexpr,
                DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    """Rotate `heads` heads at `src` (rows of 2 * HALF) into `dst`; returns the rotated halves in fp32.
    HF: x * cos + rotate_half(x) * sin, each product and the sum rounded to DTYPE."""
    h = tl.arange(0, NUM)[:, None]
    d = tl.arange(0, HALF)[None, :]
    ok = h < heads
    x1 = tl.load(src + h * 2 * HALF + d, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + h * 2 * HALF + HALF + d, mask=ok, other=0.0).to(tl.float32)
    # rotate_half(x) = (-x2, x1); -(a * b) rounds as (-a) * b does, so a subtraction is the same sum.
    o1 = round_f32(round_f32(x1 * cos, DTYPE, EMULATE) - round_f32(x2 * sin, DTYPE, EMULATE), DTYPE, EMULATE)
    o2 = round_f32(round_f32(x2 * cos, DTYPE, EMULATE) + round_f32(x1 * sin, DTYPE, EMULATE), DTYPE, EMULATE)
    tl.store(dst + h * dst_stride + d, o1.to(DTYPE), mask=ok)
    tl.store(dst + h * dst_stride + HALF + d, o2.to(DTYPE), mask=ok)
    return o1, o2


@triton.jit
def _store_kv(cache, x, mask, KV_FP8: tl.constexpr, EMULATE: tl.constexpr):
    """Store fp32 `x` at `cache` rounded to the cache's element type (fp8: its uint8 bits)."""
    if KV_FP8:
        tl.store(cache, f32_to_e5m2(x), mask=mask)
    else:
        tl.store(cache, round_to(x, cache.dtype.element_ty, EMULATE), mask=mask)


@triton.jit
def _rope_store_kernel(qkv_ptr, q_ptr, cs_ptr, pos_ptr, k_ptr, v_ptr, slot_ptr, stride_qt, stride_qh,
                       stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                       H: tl.constexpr, KVH: tl.constexpr, HALF: tl.constexpr, HP: tl.constexpr, KVP: tl.constexpr,
                       BLOCK_SIZE: tl.constexpr, KV_FP8: tl.constexpr, EMULATE: tl.constexpr):
    DTYPE: tl.constexpr = qkv_ptr.dtype.element_ty
    D: tl.constexpr = 2 * HALF
    t = tl.program_id(0).to(tl.int64)
    row = qkv_ptr + t * (H + 2 * KVH) * D
    d = tl.arange(0, HALF)[None, :]
    # NOTE: the position must index `cos_sin` even on a padding row (its rotations are discarded).
    cs = cs_ptr + tl.load(pos_ptr + t) * D
    cos = round_f32(tl.load(cs + d), DTYPE, EMULATE)  # HF casts cos/sin to the model dtype first
    sin = round_f32(tl.load(cs + HALF + d), DTYPE, EMULATE)
    _rope_heads(row, q_ptr + t * stride_qt, stride_qh, cos, sin, H, HP, HALF, DTYPE, EMULATE)
    k1, k2 = _rope_heads(row + H * D, row + H * D, D, cos, sin, KVH, KVP, HALF, DTYPE, EMULATE)
    slot = tl.load(slot_ptr + t)
    h = tl.arange(0, KVP)[:, None]
    # A negative slot is a padding row: it stores nothing. (Not `(h < KVH) & (slot >= 0)`: Triton 3.9's
    # interpreter widens a block-and-scalar bool `&` to int32, which `tl.store` refuses as a mask.)
    ok = h < tl.where(slot >= 0, KVH, 0)
    blk, off = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    kc = k_ptr + blk * stride_kb + off * stride_ks + h * stride_kh + d
    _store_kv(kc, k1, ok, KV_FP8, EMULATE)
    _store_kv(kc + HALF, k2, ok, KV_FP8, EMULATE)
    vsrc = row + (H + KVH) * D + h * D + d
    vc = v_ptr + blk * stride_vb + off * stride_vs + h * stride_vh + d
    _store_kv(vc, tl.load(vsrc, mask=ok, other=0.0).to(tl.float32), ok, KV_FP8, EMULATE)
    _store_kv(vc + HALF, tl.load(vsrc + HALF, mask=ok, other=0.0).to(tl.float32), ok, KV_FP8, EMULATE)


def check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """One layer's K and V views of the block-major cache: [num_blocks, block_size, kv_heads, head_dim],
    dims 1-3 contiguous (dim 0 may stride over the other layers' blocks)."""
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, "k_cache/v_cache: [blocks, block_size, kv_heads, head_dim]"
    assert k_cache.dtype == v_cache.dtype and k_cache.dtype in KV_DTYPES, f"unsupported KV dtype {k_cache.dtype}"
    _, _, kvh, d = k_cache.shape
    for c in (k_cache, v_cache):
        assert c.stride()[1:] == (kvh * d, d, 1), "k_cache/v_cache: dims 1-3 must be contiguous"


def kv_pointer(cache: torch.Tensor) -> torch.Tensor:
    """What the kernels read and write: fp8 caches as their bytes (decoded and rounded in the kernel)."""
    return cache.view(torch.uint8) if cache.dtype == torch.float8_e5m2 else cache


def rope_store(qkv: torch.Tensor, q_out: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int) -> None:
    """Rotary embedding (neox, HF's rotate_half) of q and k, and the KV-cache write, in one launch.

    qkv: [T, (H + 2 KVH) * D] contiguous, the fused q|k|v projection (fp32/bf16/fp16); its k part is
    rotated in place. q_out: [T, H, D] (dims 1-2 contiguous), the rotated queries. cos_sin: [max_pos, D]
    fp32, cos of the D/2 frequencies then their sin. positions: [T] int64. k_cache, v_cache: one layer's
    views (`check_kv_cache`); k and v are stored rounded to the cache's type as torch's `.to` rounds.
    slot_mapping: [T] int64, block * block_size + offset; negative: a padding row, nothing stored.
    Rounding: as HF in the model dtype (cos/sin cast to it, each product and the sum rounded), so the
    result matches torch's bit for bit (on a GPU, unless the compiler fuses a product into an fma: the
    launch turns fusion off)."""
    check_kv_cache(k_cache, v_cache)
    _, block_size, kvh, d = k_cache.shape
    T = qkv.shape[0]
    assert d >= 2 and d & (d - 1) == 0, f"head_dim must be a power of two (got {d})"
    assert qkv.dim() == 2 and qkv.is_contiguous() and qkv.dtype in _FLOAT_DTYPES, "qkv must be [T, width] contiguous"
    assert qkv.shape[1] == (num_heads + 2 * kvh) * d, \
        f"qkv's width {qkv.shape[1]} != (num_heads {num_heads} + 2 * kv_heads {kvh}) * head_dim {d}"
    assert q_out.shape == (T, num_heads, d) and q_out.dtype == qkv.dtype and q_out.stride()[1:] == (d, 1), \
        f"q_out must be [{T}, {num_heads}, {d}] {qkv.dtype} with contiguous heads"
    assert cos_sin.dtype == torch.float32 and cos_sin.is_contiguous() and cos_sin.shape[1] == d, \
        f"cos_sin must be [max_pos, {d}] contiguous fp32"
    assert positions.shape == (T,) and slot_mapping.shape == (T,), "positions and slot_mapping must be [T]"
    assert positions.dtype == torch.int64 and slot_mapping.dtype == torch.int64, "positions/slot_mapping: int64"
    if T == 0:
        return
    kc, vc = kv_pointer(k_cache), kv_pointer(v_cache)
    _rope_store_kernel[(T,)](
        qkv, q_out, cos_sin, positions.contiguous(), kc, vc, slot_mapping.contiguous(), q_out.stride(0), q_out.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2),
        H=num_heads, KVH=kvh, HALF=d // 2, HP=triton.next_power_of_2(num_heads), KVP=triton.next_power_of_2(kvh),
        BLOCK_SIZE=block_size, KV_FP8=k_cache.dtype == torch.float8_e5m2, EMULATE=interpreted(_rope_store_kernel),
        num_warps=num_warps_for(triton.next_power_of_2(num_heads) * d), enable_fp_fusion=False)
