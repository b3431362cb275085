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


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(9, 3, 64, 16), (4, 4, 16, 4), (8, 1, 32, 8)])
def test_kernel_equals_gather_sdpa(heads, kv_heads, head_dim, block_size):
    g = torch.Generator().manual_seed(heads * 100 + kv_heads)
    num_blocks, layers = 200, 3
    cache = torch.randn(num_blocks, layers, 2, block_size, kv_heads, head_dim, generator=g)
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


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 2, 16)])
def test_rope_store_equals_torch_bit_for_bit(heads, kv_heads, head_dim):
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
    cache = torch.zeros(num_blocks, layers, 2, block_size, kv_heads, head_dim)
    ref_cache = cache.clone()
    nq, nkv = heads * head_dim, kv_heads * head_dim
    q = qkv[:, :nq].view(T, heads, head_dim)
    k = qkv[:, nq:nq + nkv].reshape(T, kv_heads, head_dim)
    v = qkv[:, nq + nkv:].reshape(T, kv_heads, head_dim)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    want_q, want_k = q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s
    ref_cache[slot_blocks, 1, 0, slot_offsets] = want_k
    ref_cache[slot_blocks, 1, 1, slot_offsets] = v

    got_q = torch.empty(T, heads, head_dim)
    v_before = v.clone()
    cpu_kernels.rope_store(qkv, got_q, cos, sin, cache[:, 1, 0], cache[:, 1, 1], slot_blocks, slot_offsets, heads)
    assert torch.equal(got_q, want_q)
    assert torch.equal(qkv[:, nq:nq + nkv].view(T, kv_heads, head_dim), want_k)  # k rotated in place
    assert torch.equal(qkv[:, nq + nkv:].view(T, kv_heads, head_dim), v_before)  # v untouched
    assert torch.equal(cache, ref_cache)  # only this layer's slots were written


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


@needs_kernel
@pytest.mark.parametrize("n", [1536, 37])
def test_silu_mul_matches_torch(n):
    g = torch.Generator().manual_seed(n)
    gate_up = torch.randn(5, 2 * n, generator=g) * 8
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -88.5])  # far tails: no inf, no NaN
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(cpu_kernels.silu_mul(gate_up), torch.nn.functional.silu(gate) * up,
                               rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("fused", [True, False], ids=["fused-ops", "torch-ops"])
@pytest.mark.parametrize("model_type", ["llama", "mistral"])
def test_fused_ops_match_hf(tiny_model_dir, model_type, fused):
    """Greedy outputs equal transformers' with the fused per-token ops and without them."""
    engine = LLMEngine(EngineConfig(model=tiny_model_dir(model_type), num_kv_blocks=128, block_size=4))
    if fused and not engine.runner.fused_ops:
        pytest.skip("the CPU kernels did not build here")
    assert engine.runner._fuse_norm and engine.runner._fuse_rope and engine.runner._fuse_silu
    engine.runner.fused_ops = fused
    check_against_hf(engine, make_prompts(10, engine.vocab_size, seed=7))
