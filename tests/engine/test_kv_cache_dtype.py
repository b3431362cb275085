"""A KV cache narrower than the model (`kv_cache_dtype`): what is stored and what greedy decoding gives.

The oracle is transformers' own `generate` with its attention reading K and V rounded to the cache's
element type (an attention function registered through `AttentionInterface` that rounds, then runs
HF's SDPA attention). The engine rounds once when it stores; HF keeps fp32 and rounds every time it
reads: the same values either way, so greedy tokens must agree exactly, as in fp32.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from engine import EngineConfig, LLMEngine
from engine.errors import EngineConfigError
from device_params import DEVICES, EXACT_DTYPE
from test_correctness import check_against_hf, make_prompts, run_staggered

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "fp8_e5m2": torch.float8_e5m2}


@contextmanager
def hf_reads_rounded_kv(hf_model, kv_dtype: torch.dtype):
    """Within the block, `hf_model`'s attention sees K and V rounded to `kv_dtype`."""
    def attention(module, query, key, value, attention_mask, **kwargs):
        key, value = key.to(kv_dtype).to(query.dtype), value.to(kv_dtype).to(query.dtype)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    name = f"pdserve_rounded_kv_{str(kv_dtype).removeprefix('torch.')}"
    AttentionInterface.register(name, attention)
    before = hf_model.config._attn_implementation
    hf_model.set_attn_implementation(name)
    try:
        yield
    finally:
        hf_model.set_attn_implementation(before)


def _engine(path: str, device: str, **kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig(model=path, device=device, dtype=EXACT_DTYPE, **kwargs))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_cache_dtype", list(TORCH_DTYPES))
def test_narrow_kv_cache_matches_hf_reading_rounded_kv(tiny_model_dir, kv_cache_dtype, device):
    engine = _engine(tiny_model_dir("llama"), device, num_kv_blocks=128, block_size=4, kv_cache_dtype=kv_cache_dtype)
    assert engine.runner.kv_cache.dtype == TORCH_DTYPES[kv_cache_dtype]
    with hf_reads_rounded_kv(engine.hf_model, TORCH_DTYPES[kv_cache_dtype]):
        check_against_hf(engine, make_prompts(10, engine.vocab_size, seed=11))
    assert engine.check_integrity() is None


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_cache_changes_outputs(tiny_model_dir, device):
    """The rounding is real: an fp8 cache changes some greedy outputs of the same engine in fp32."""
    outs = {}
    for kv in ("auto", "fp8_e5m2"):
        engine = _engine(tiny_model_dir("llama"), device, num_kv_blocks=128, block_size=4, kv_cache_dtype=kv)
        outs[kv] = run_staggered(engine, make_prompts(10, engine.vocab_size, seed=11), 24)
    assert outs["auto"] != outs["fp8_e5m2"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "fp8_e5m2"])
def test_narrow_kv_cache_torch_path_chunked_and_preempted_matches_hf(tiny_model_dir, kv_cache_dtype, device):
    """Without the CPU kernels (the gather + SDPA path, as on a GPU), with prompts split into chunks
    and sequences preempted and recomputed: each token's K/V is rounded once, whatever the chunking."""
    engine = _engine(tiny_model_dir("qwen2"), device, num_kv_blocks=48, block_size=4, max_num_batched_tokens=16,
                     kv_cache_dtype=kv_cache_dtype)
    engine.runner.paged_decode = engine.runner.fused_ops = False
    with hf_reads_rounded_kv(engine.hf_model, TORCH_DTYPES[kv_cache_dtype]):
        check_against_hf(engine, make_prompts(10, engine.vocab_size, seed=12), arrive_every=1)
    assert engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("device", DEVICES)
def test_kv_cache_memory_budget_counts_the_element_size(tiny_model_dir, device):
    blocks = {}
    for kv in ("auto", "bfloat16", "fp8_e5m2"):
        engine = _engine(tiny_model_dir("llama"), device, kv_cache_memory_mb=4, block_size=4, kv_cache_dtype=kv)
        blocks[kv] = engine.block_manager.num_blocks
        assert engine.runner.kv_cache.numel() * engine.runner.kv_cache.element_size() <= 4 * 2**20
    assert blocks["bfloat16"] == 2 * blocks["auto"] and blocks["fp8_e5m2"] == 4 * blocks["auto"]


def test_unknown_kv_cache_dtype_names_the_field():
    with pytest.raises(EngineConfigError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int4")
