"""The compiled CPU decode-attention kernel: equal to the gather + SDPA path it replaces, and the
engine's greedy outputs stay equal to transformers' with either path."""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from engine import EngineConfig, LLMEngine
from engine.attention import AttentionMetadata, KVWorkspace, decode_buckets, paged_attention, paged_decode_meta
from engine.cpu_kernels import paged_decode_available
from test_correctness import check_against_hf, make_prompts

needs_kernel = pytest.mark.skipif(not paged_decode_available(torch.device("cpu"), torch.float32),
                                  reason="the CPU kernel did not build here (no C compiler?)")


@pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None, reason="no C compiler")
def test_kernel_builds_where_a_compiler_is():
    assert paged_decode_available(torch.device("cpu"), torch.float32)
    assert not paged_decode_available(torch.device("cpu"), torch.bfloat16)  # fp32 only: others take SDPA


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
