"""`dtype="bfloat16"` on a CPU: the linear layers multiply in bf16 (the CPU's bf16 hardware), the rest
computes in fp32 over a bf16 KV cache (engine/llm_engine.py). Not exact (bf16 rounds the products'
inputs), so the check against transformers' fp32 generate is an agreement bound, measured here at
13 of 16 chat answers identical over their first 16 tokens."""

from __future__ import annotations

import pytest
import torch

from device_params import skip_without_default_model
from engine import EngineConfig, LLMEngine, SamplingParams
from helpers import run_offline

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
             "Explain what a KV cache is in one sentence.", "Hi", "What is 12 times 7?", "Why is the sky blue?",
             "Name a famous painting by Leonardo da Vinci.", "Give me a synonym for happy.", "What do bees make?",
             "Describe a cat in five words.", "What is the boiling point of water?", "Say hello in French.",
             "Count from one to five.", "What color is grass?", "Name a planet in our solar system."]


def test_bf16_on_cpu_multiplies_in_bf16_over_fp32_activations(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model=tiny_model_dir("llama"), dtype="bfloat16", num_kv_blocks=64))
    runner = engine.runner
    assert engine.config.dtype == "bfloat16"
    assert runner.dtype == torch.float32 and runner.matmul_dtype == torch.bfloat16
    assert runner.kv_cache.dtype == torch.bfloat16  # kv_cache_dtype auto: the model's dtype
    for lin in (runner.model.lin_qkv[0], runner.model.lin_head):  # the products read bf16 weights, and no fp32 copy
        assert lin.matmul_dtype == torch.bfloat16
        assert (lin.packed if lin.packed is not None else lin.weight).dtype == torch.bfloat16
    out = run_offline(engine, [[5, 6, 7, 8]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 8
    engine.check_integrity()
    assert engine.block_manager.num_used_blocks == 0
    # fp32 stays what it was: no bf16 anywhere.
    fp32 = LLMEngine(EngineConfig(model=tiny_model_dir("llama"), num_kv_blocks=64)).runner
    assert fp32.matmul_dtype is None and fp32.model.lin_qkv[0].weight.dtype == torch.float32


@pytest.mark.slow  # ~40 s on 2 cores: SmolLM2 in bf16 against transformers in fp32
def test_bf16_on_cpu_mostly_agrees_with_transformers_fp32():
    skip_without_default_model()
    engine = LLMEngine(EngineConfig(dtype="bfloat16", num_kv_blocks=512))
    prompts = [engine.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    outs = run_offline(engine, prompts, SamplingParams(max_tokens=16, temperature=0))
    agree = 0
    for prompt, out in zip(prompts, outs):
        with torch.inference_mode():
            ids = torch.tensor([prompt])
            want = engine.hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16,
                                            do_sample=False)[0, len(prompt):].tolist()
        want = [t for t in want if t not in engine.eos_token_ids]
        agree += out.token_ids == want[:len(out.token_ids)] and len(out.token_ids) == len(want)
    assert agree >= 10, f"only {agree} of {len(QUESTIONS)} answers agree with fp32 over 16 tokens"
