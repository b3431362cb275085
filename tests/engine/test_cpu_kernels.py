"""The compiled CPU kernels: decode attention equal to the gather + SDPA path it replaces; the fused
per-token ops equal to the torch ops they replace; the engine's greedy outputs equal to transformers'
with either path."""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from engine import EngineConfig, LLMEngine
from engine.attention import AttentionMetadata, KVWorkspace, decode_buckets, paged_attention, paged_decode_meta
from engine import cpu_kernels
from test_correctness import check_against_hf, make_prompts

needs_kernel = pytest.mark.skipif(not cpu_kernels.available(torch.device("cpu"), torch.float32),
                                  reason="the CPU kernel did not build here (no C compiler?)")


@pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None, reason="no C compiler")
def test_kernel_builds_where_a_compiler_is():
    assert cpu_kernels.available(torch.device("cpu"), torch.float32)
    assert not cpu_kernels.available(torch.device("cpu"), torch.bfloat16)  # fp32 only: others take SDPA


KV_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e5m2]


@needs_kernel
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(9, 3, 64, 16), (4, 4, 16, 4), (8, 1, 32, 8)])
def test_kernel_equals_gather_sdpa(heads, kv_heads, head_dim, block_size, kv_dtype):
    # head_dim 64 and 32: the register path built for the shape; 16: the generic one
    assert cpu_kernels.prepare_decode(heads, kv_heads, head_dim) == (head_dim != 16)
    g = torch.Generator().manual_seed(heads * 100 + kv_heads)
    num_blocks, layers = 200, 3
    cache = torch.randn(num_blocks, layers, 2, block_size, kv_heads, head_dim, generator=g).to(kv_dtype)
    k_cache, v_cache = cache[:, 1, 0], cache[:, 1, 1]  # a middle layer: blocks strided over all layers
    lens = [1, block_size, block_size + 1, 3 * block_size - 1, 57, 130]
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = [], 0
    for n in lens:
        nb = -(-n // block_size) + 1  # one spare block at the end, as a running sequence has
        tables.append(perm[used:used + nb])
        used += nb
    # Decode rows scattered among other rows (a mixed step): rows 1, 3, 4, 6, 8, 9 of 10.
    rows = [1, 3, 4, 6, 8, 9]
    q = torch.randn(10, heads, head_dim, generator=g)
    scale = 1 / math.sqrt(head_dim)
    empty = torch.zeros(0, dtype=torch.long)
    ref_meta = AttentionMetadata(empty, empty, decode_buckets(rows, tables, lens, block_size, q.device), [])
    ref = paged_attention(q, None, None, k_cache, v_cache, ref_meta, scale, KVWorkspace())
    meta = AttentionMetadata(empty, empty, [], [], paged_decode_meta(rows, tables, lens, block_size))
    got = paged_attention(q, None, None, k_cache, v_cache, meta, scale, KVWorkspace())
    torch.testing.assert_close(got[rows], ref[rows], rtol=1e-5, atol=1e-5)
    # Rows 0..n-1 (a decode-only step) take the in-place route.
    meta = AttentionMetadata(empty, empty, [], [], paged_decode_meta(list(range(6)), tables, lens, block_size))
    assert meta.paged.rows is None
    got = paged_attention(q[rows].contiguous(), None, None, k_cache, v_cache, meta, scale, KVWorkspace())
    torch.testing.assert_close(got, ref[rows], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "gather-sdpa"])
def test_both_decode_paths_match_hf(tiny_model_dir, kernel):
    engine = LLMEngine(EngineConfig(model=tiny_model_dir("qwen2"), num_kv_blocks=128, block_size=4))
    if kernel and not engine.runner.paged_decode:
        pytest.skip("the CPU kernel did not build here")
    engine.runner.paged_decode = kernel
    check_against_hf(engine, make_prompts(10, engine.vocab_size, seed=5))


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@needs_kernel
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 2, 16)])
def test_rope_store_equals_torch_bit_for_bit(heads, kv_heads, head_dim, kv_dtype):
    g = torch.Generator().manual_seed(heads)
    T, num_blocks, block_size, layers = 13, 40, 4, 3
    qkv = torch.randn(T, (heads + 2 * kv_heads) * head_dim, generator=g)
    pos = torch.randint(0, 500, (T,), generator=g).float()
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(pos, inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    slot_blocks = torch.randperm(num_blocks, generator=g)[:T]
    slot_offsets = torch.randint(0, block_size, (T,), generator=g)
    cache = torch.zeros(num_blocks, layers, 2, block_size, kv_heads, head_dim, dtype=kv_dtype)
    ref_cache = cache.clone()
    nq, nkv = heads * head_dim, kv_heads * head_dim
    q = qkv[:, :nq].view(T, heads, head_dim)
    k = qkv[:, nq:nq + nkv].reshape(T, kv_heads, head_dim)
    v = qkv[:, nq + nkv:].reshape(T, kv_heads, head_dim)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    want_q, want_k = q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s
    ref_cache[slot_blocks, 1, 0, slot_offsets] = want_k.to(kv_dtype)  # stored as torch rounds
    ref_cache[slot_blocks, 1, 1, slot_offsets] = v.to(kv_dtype)

    got_q = torch.empty(T, heads, head_dim)
    v_before = v.clone()
    cpu_kernels.rope_store(qkv, got_q, cos, sin, cache[:, 1, 0], cache[:, 1, 1], slot_blocks, slot_offsets, heads)
    assert torch.equal(got_q, want_q)
    assert torch.equal(qkv[:, nq:nq + nkv].view(T, kv_heads, head_dim), want_k)  # k rotated in place
    assert torch.equal(qkv[:, nq + nkv:].view(T, kv_heads, head_dim), v_before)  # v untouched
    assert torch.equal(_bytes(cache), _bytes(ref_cache))  # only this layer's slots were written


@needs_kernel
@pytest.mark.parametrize("kv_dtype", KV_DTYPES[1:], ids=str)
def test_narrow_cache_rounds_as_torch_does(kv_dtype):
    """Stores round to nearest even exactly as `.to(kv_dtype)`: ties, subnormals, overflow, inf, NaN."""
    g = torch.Generator().manual_seed(7)
    f = torch.cat([torch.randn(4000, generator=g) * 10.0 ** torch.randint(-9, 6, (4000,), generator=g),
                   torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 57344.0, 61439.0, 61440.0,
                                 65504.0, 65520.0, 1e6, 3e38, 2.0 ** -14, 2.0 ** -16, 2.0 ** -17, 1.5 * 2.0 ** -17,
                                 2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -26, 1e-30, 1.125, 1.375, 1.0 + 2.0 ** -8,
                                 1.0 + 3 * 2.0 ** -8, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11])])
    f = torch.cat([f, -f])
    head_dim = 64
    T = -(-f.numel() // head_dim)
    vals = torch.zeros(T * head_dim)
    vals[:f.numel()] = f
    # Stored through V (not rotated): T tokens, 1 q head, 1 kv head; K gets zeros.
    qkv = torch.zeros(T, 3 * head_dim)
    qkv[:, 2 * head_dim:] = vals.view(T, head_dim)
    cos, sin = torch.ones(T, head_dim), torch.zeros(T, head_dim)
    cache = torch.zeros(T, 1, 2, 1, 1, head_dim, dtype=kv_dtype)
    cpu_kernels.rope_store(qkv, torch.empty(T, 1, head_dim), cos, sin, cache[:, 0, 0], cache[:, 0, 1],
                           torch.arange(T), torch.zeros(T, dtype=torch.long), 1)
    got, want = _bytes(cache[:, 0, 1].reshape(-1)), _bytes(vals.to(kv_dtype))
    nan = torch.isnan(vals)
    assert torch.equal(got[~nan.repeat_interleave(kv_dtype.itemsize)], want[~nan.repeat_interleave(kv_dtype.itemsize)])
    assert torch.isnan(cache[:, 0, 1].reshape(-1)[nan].float()).all()  # NaN stays NaN (any payload)


@needs_kernel
@pytest.mark.parametrize("n", [576, 40])  # whole vectors, and a remainder
def test_add_rmsnorm_matches_hf(n):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    g = torch.Generator().manual_seed(n)
    norm = LlamaRMSNorm(n, eps=1e-5)
    norm.weight.data = torch.randn(n, generator=g)
    x, delta = torch.randn(7, n, generator=g) * 3, torch.randn(7, n, generator=g)
    want_h = x + delta
    with torch.no_grad():
        want = norm(want_h)
        got = cpu_kernels.add_rmsnorm(x, delta, norm.weight, norm.variance_epsilon)
    assert torch.equal(x, want_h)  # the residual add is in place and rounds as torch's
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(cpu_kernels.add_rmsnorm(x, None, norm.weight, 1e-5), norm(x), rtol=2e-6, atol=1e-6)
    # bf16 out (the CPU bf16 path's matmul input): the fp32 result rounded once, bit for bit.
    fp32 = cpu_kernels.add_rmsnorm(x, None, norm.weight, 1e-5)
    bf16 = cpu_kernels.add_rmsnorm(x, None, norm.weight, 1e-5, torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, fp32.to(torch.bfloat16))


@needs_kernel
@pytest.mark.parametrize("n", [1536, 37])
def test_silu_mul_matches_torch(n):
    g = torch.Generator().manual_seed(n)
    gate_up = torch.randn(5, 2 * n, generator=g) * 8
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -88.5])  # far tails: no inf, no NaN
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(cpu_kernels.silu_mul(gate_up), torch.nn.functional.silu(gate) * up,
                               rtol=2e-6, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize("n", [1536, 37])
def test_silu_mul_bf16_is_the_fp32_kernel_rounded_once(n):
    # The bf16 path's MLP: bf16 products in, bf16 out, bit for bit the fp32 kernel then torch's rounding
    # (inf included; a NaN stays a NaN), so the shortcut changes no number.
    g = torch.Generator().manual_seed(n)
    gate_up = (torch.randn(7, 2 * n, generator=g) * 8).to(torch.bfloat16)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -88.5])
    gate_up[1, :3] = torch.tensor([float("nan"), float("inf"), float("-inf")])
    gate_up[1, n:n + 3] = torch.tensor([1.0, 2.0, 3.0])
    got = cpu_kernels.silu_mul(gate_up)
    want = cpu_kernels.silu_mul(gate_up.float()).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == (7, n)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert got.isnan().sum() == 1


@needs_kernel
@pytest.mark.parametrize("n", [1, 5, 16, 17, 1000, 49152])
def test_argmax_rows_equals_torch(n):
    # Same index as torch: the first of equal maxima, the first NaN, 0 for a row of -inf.
    g = torch.Generator().manual_seed(n)
    x = torch.randn(37, n, generator=g)
    x[3] = float("-inf")
    x[4, n // 2] = float("nan")
    x[5] = 1.0
    if n > 3:
        x[6, 1] = x[6, 3] = 100.0
        x[7, 0] = x[7, n - 1] = float("nan")
        x[8, n - 1] = float("inf")
        x[9, 2] = float("-inf")
    got = cpu_kernels.argmax_rows(x)
    assert got is not None and torch.equal(got, x.argmax(dim=-1))
    assert cpu_kernels.argmax_rows(x[:, :1].contiguous().double()) is None  # not fp32: torch's argmax


@pytest.mark.parametrize("fused", [True, False], ids=["fused-ops", "torch-ops"])
@pytest.mark.parametrize("model_type", ["llama", "mistral"])
def test_fused_ops_match_hf(tiny_model_dir, model_type, fused):
    """Greedy outputs equal transformers' with the fused per-token ops and without them."""
    engine = LLMEngine(EngineConfig(model=tiny_model_dir(model_type), num_kv_blocks=128, block_size=4))
    if fused and not engine.runner.fused_ops:
        pytest.skip("the CPU kernels did not build here")
    m = engine.runner.model
    assert m.plain_norms and m.fuse_silu and not hasattr(m.layers[0].self_attn, "q_norm")
    engine.runner.fused_ops = fused
    check_against_hf(engine, make_prompts(10, engine.vocab_size, seed=7))
