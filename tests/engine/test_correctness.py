"""Greedy outputs equal transformers' own `generate`, token for token, in one continuous batch; on the
CPU and, where there is one, on a CUDA GPU (`conftest.DEVICES`)."""

from __future__ import annotations

import random

import pytest
import torch

from device_params import DEVICES, EXACT_DTYPE, skip_without_default_model
from engine import EngineConfig, LLMEngine, SamplingParams

MAX_NEW = 24


def hf_greedy(hf_model, prompt_ids: list[int], max_new: int, eos_ids: frozenset[int]) -> list[int]:
    with torch.inference_mode():
        dev = hf_model.device
        out = hf_model.generate(torch.tensor([prompt_ids], device=dev), max_new_tokens=max_new, do_sample=False,
                                attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long, device=dev))
    gen = out[0, len(prompt_ids):].tolist()
    for i, t in enumerate(gen):  # our outputs exclude EOS and stop there
        if t in eos_ids:
            return gen[:i]
    return gen


def make_prompts(n: int, vocab: int, seed: int, lengths=(3, 7, 12, 20, 33, 50, 64, 90, 130, 5)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


def run_staggered(engine: LLMEngine, prompts: list[list[int]], max_new: int, arrive_every: int = 2) -> dict[str, list[int]]:
    """Requests arrive at different steps, so they join a batch that is already decoding."""
    params = SamplingParams(max_tokens=max_new, temperature=0)
    results: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    step = 0
    max_batch = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % arrive_every == 0:
            i, p = pending.pop(0)
            engine.add_request(f"r{i}", p, params)
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.token_ids
        max_batch = max(max_batch, engine.last_step.num_seqs)
        step += 1
        assert step < 10_000
    assert max_batch > 1, "requests never shared a step"
    engine.check_integrity()
    assert engine.block_manager.num_used_blocks == 0
    return results


def check_against_hf(engine: LLMEngine, prompts, max_new=MAX_NEW, arrive_every=2):
    got = run_staggered(engine, prompts, max_new, arrive_every)
    for i, p in enumerate(prompts):
        want = hf_greedy(engine.hf_model, p, max_new, engine.eos_token_ids)
        assert got[f"r{i}"] == want, f"prompt {i} (len {len(p)}) differs"


def tiny_engine(path: str, device: str, **kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig(model=path, device=device, dtype=EXACT_DTYPE, **kwargs))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
def test_tiny_models_match_hf(tiny_model_dir, model_type, device):
    engine = tiny_engine(tiny_model_dir(model_type), device, num_kv_blocks=128, block_size=4)
    assert engine.runner.kv_cache.device.type == device
    check_against_hf(engine, make_prompts(10, engine.vocab_size, seed=1))


@pytest.mark.parametrize("device", DEVICES)
def test_tiny_preemption_matches_hf(tiny_model_dir, device):
    # 24 blocks of 4 tokens cannot hold 10 requests of up to 154 tokens: preemption must happen.
    engine = tiny_engine(tiny_model_dir("llama"), device, num_kv_blocks=48, block_size=4, max_num_batched_tokens=64)
    check_against_hf(engine, make_prompts(10, engine.vocab_size, seed=2), arrive_every=1)
    assert engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("device", DEVICES)
def test_tiny_chunked_prefill_matches_hf(tiny_model_dir, device):
    engine = tiny_engine(tiny_model_dir("qwen2"), device, num_kv_blocks=256, block_size=4, max_num_batched_tokens=16)
    check_against_hf(engine, make_prompts(8, engine.vocab_size, seed=3))


@pytest.mark.parametrize("device", DEVICES)
def test_tiny_prefill_cap_keeps_decodes_going_and_matches_hf(tiny_model_dir, device):
    # At most 8 prompt tokens a step: long prompts take many steps, mixed with the running decodes.
    engine = tiny_engine(tiny_model_dir("llama"), device, num_kv_blocks=256, block_size=4,
                         max_prefill_tokens_per_step=8)
    steps = []
    step = engine.step

    def recording_step():
        outs = step()
        steps.append(engine.last_step)
        return outs

    engine.step = recording_step
    check_against_hf(engine, make_prompts(8, engine.vocab_size, seed=4))
    assert max(s.num_prefill_tokens for s in steps) == 8
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in steps)


@pytest.mark.parametrize("device", DEVICES)
def test_tiny_prefix_cache_hits_match_hf(tiny_model_dir, device):
    # Prompts sharing a 30-token prefix, and a repeat of a finished prompt: later ones take the shared
    # blocks from the prefix cache (some while their first owner still runs) and compute the rest.
    engine = tiny_engine(tiny_model_dir("llama"), device, num_kv_blocks=256, block_size=4)
    rng = random.Random(5)
    shared = [rng.randrange(3, engine.vocab_size) for _ in range(30)]
    prompts = [shared + [rng.randrange(3, engine.vocab_size) for _ in range(n)] for n in (1, 5, 9, 17, 2)]
    prompts.append(list(prompts[1]))
    cached = {}
    step = engine.step

    def recording_step():
        outs = step()
        cached.update({o.request_id: o.num_cached_tokens for o in outs})
        return outs

    engine.step = recording_step
    check_against_hf(engine, prompts)
    assert cached["r0"] == 0 and all(cached[f"r{i}"] == 28 for i in range(1, 5))  # 7 full blocks of 4
    assert cached["r5"] == 32  # all but the block of its last token
    assert engine.block_manager.num_cached_blocks > 0


@pytest.fixture(scope="module", params=DEVICES)
def smol(request):
    skip_without_default_model()
    return tiny_engine(None, request.param, num_kv_blocks=512, block_size=16, max_num_batched_tokens=256)


SMOL_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a KV cache is in one sentence.",
    "Hi",
    "Translate 'good morning' into Spanish and then into German, and explain the difference in usage between them.",
    "What is 12 times 7?",
    "Name a famous painting by Leonardo da Vinci and describe it briefly in a couple of sentences.",
    "Why is the sky blue?",
]


def test_smollm2_matches_hf_continuous_chunked(smol):
    prompts = [smol.apply_chat_template([{"role": "user", "content": p}]) for p in SMOL_PROMPTS]
    check_against_hf(smol, prompts, max_new=32)


@pytest.mark.parametrize("device", DEVICES)
def test_smollm2_preemption_matches_hf(device):
    skip_without_default_model()
    engine = tiny_engine(None, device, num_kv_blocks=12, block_size=16, max_num_batched_tokens=128)
    prompts = [engine.apply_chat_template([{"role": "user", "content": p}]) for p in SMOL_PROMPTS[:8]]
    check_against_hf(engine, prompts, max_new=32, arrive_every=1)
    assert engine.scheduler.num_preemptions > 0


@pytest.mark.gpu
def test_cuda_forward_never_synchronizes(tiny_model_dir):
    """The model runner's forward pass on CUDA (prefills, chunks, cached prefixes, decode buckets with
    and without masks) queues its work without waiting for the device: its inputs go in one
    non-blocking copy from pinned memory. Sampling's read of the tokens is the step's one wait."""
    engine = tiny_engine(tiny_model_dir("llama"), "cuda", num_kv_blocks=256, block_size=4, max_num_batched_tokens=32)
    run = engine.runner.run
    calls = []

    def checked(sched):
        torch.cuda.set_sync_debug_mode("error")  # a synchronizing CUDA call raises
        try:
            calls.append(len(sched.chunks))
            return run(sched)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    engine.runner.run = checked
    prompts = make_prompts(10, engine.vocab_size, seed=6)
    prompts.append(list(prompts[3]))  # a cached prefix: a prefill chunk attending to cached blocks
    got = run_staggered(engine, prompts, 12)
    assert len(calls) > 10
    engine.runner.run = run
    for i, p in enumerate(prompts):
        assert got[f"r{i}"] == hf_greedy(engine.hf_model, p, 12, engine.eos_token_ids)


@pytest.mark.gpu
def test_tiny_bfloat16_on_cuda_tracks_hf(tiny_model_dir):
    """bf16, the dtype a CUDA engine serves in. Kernels of other shapes round differently, so tokens may
    part from transformers' bf16 `generate` after a while; most prompts agree on their first 8."""
    engine = LLMEngine(EngineConfig(model=tiny_model_dir("llama"), device="cuda", dtype="bfloat16",
                                    num_kv_blocks=128, block_size=4))
    assert engine.runner.kv_cache.dtype == torch.bfloat16
    prompts = make_prompts(10, engine.vocab_size, seed=1)
    got = run_staggered(engine, prompts, 8)
    same = sum(got[f"r{i}"] == hf_greedy(engine.hf_model, p, 8, engine.eos_token_ids) for i, p in enumerate(prompts))
    assert same >= 6, f"only {same} of {len(prompts)} prompts agree with transformers' bf16 generate on 8 tokens"
