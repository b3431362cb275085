"""Logprobs of generated tokens and of prompt tokens, against transformers' forward pass on the same
weights (fp32, tolerance ATOL), through chunked prefill, prefix-cache hits, prefill-only engines,
resumed requests and speculative decoding."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, LLMEngine, SamplingParams
from engine.logprobs import _top_k
from engine.kv_lending import KVLending

ATOL = 1e-4  # fp32 engine vs fp32 transformers: differently shaped GEMMs round differently
PROMPT = [(13 * i + 5) % 3000 + 20 for i in range(45)]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def hf(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(model_dir):
    # A small token budget: a 45-token prompt runs in three chunks.
    return LLM(model=model_dir, dtype="float32", num_kv_blocks=96, block_size=4, max_model_len=200,
               max_num_batched_tokens=16)


def reference(hf, tokens: list[int]) -> torch.Tensor:
    """Log-softmax of transformers' fp32 logits at every position of `tokens`."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([tokens])).logits[0].float(), dim=-1)


def check(entry, ref_row: torch.Tensor, token: int, k: int) -> None:
    assert entry.token_id == token
    assert abs(entry.logprob - float(ref_row[token])) < ATOL
    assert len(entry.top) == k
    ref_vals, _ = torch.topk(ref_row, k)
    for (tid, lp), rv in zip(entry.top, ref_vals.tolist()):
        assert abs(lp - rv) < ATOL and abs(float(ref_row[tid]) - lp) < ATOL
    assert [lp for _, lp in entry.top] == sorted((lp for _, lp in entry.top), reverse=True)


@pytest.mark.parametrize("temperature", [0.0, 1.5])
def test_logprobs_and_prompt_logprobs_match_transformers(llm, hf, temperature):
    out = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=temperature, seed=3, ignore_eos=True,
                                                logprobs=5, prompt_logprobs=3))[0]
    ref = reference(hf, PROMPT + out.token_ids)
    assert len(out.logprobs) == len(out.token_ids) == 8
    for i, (entry, tok) in enumerate(zip(out.logprobs, out.token_ids)):
        check(entry, ref[len(PROMPT) - 1 + i], tok, 5)  # raw: before temperature
    assert len(out.prompt_logprobs) == len(PROMPT) and out.prompt_logprobs[0] is None
    for i in range(1, len(PROMPT)):
        check(out.prompt_logprobs[i], ref[i - 1], PROMPT[i], 3)


def test_prompt_logprobs_bypass_the_prefix_cache(llm, hf):
    llm.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0))  # caches the prompt's blocks
    out = llm.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0))[0]
    assert out.num_cached_tokens == 0
    ref = reference(hf, PROMPT)
    for i in range(1, len(PROMPT)):
        check(out.prompt_logprobs[i], ref[i - 1], PROMPT[i], 0)
    again = llm.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0, logprobs=0))[0]
    assert again.num_cached_tokens > 0 and again.token_ids == out.token_ids
    llm.engine.block_manager.reset_prefix_cache()


def test_one_token_prompt_and_no_logprobs_by_default(llm):
    out = llm.generate([[42]], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2))[0]
    assert out.prompt_logprobs == [None] and out.logprobs is None
    plain = llm.generate([[42]], SamplingParams(max_tokens=2, temperature=0))[0]
    assert plain.prompt_logprobs is None and plain.logprobs is None and plain.token_ids == out.token_ids


def test_top_k_orders_ties_by_token_id():
    lp = torch.log_softmax(torch.tensor([[1.0, 3.0, 2.0, 3.0, 3.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]]), -1)
    tops = _top_k(lp, 2)
    assert [t for t, _ in tops[0]] == [1, 3] and [t for t, _ in tops[1]] == [0, 1]
    assert [t for t, _ in _top_k(lp, 4)[0]] == [1, 3, 4, 2]


def drain(eng):
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def test_prefill_only_engine_returns_both_and_a_resumed_request_continues(model_dir, hf):
    kw = dict(model=model_dir, dtype="float32", num_kv_blocks=64, block_size=4, max_model_len=200)
    pre, dec = LLMEngine(**kw), LLMEngine(**kw)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    pre.add_request("r", PROMPT, params, prefill_only=True)
    (first,) = drain(pre)["r"]
    assert first.finish_reason == "prefilled" and len(first.logprobs) == 1 and len(first.prompt_logprobs) == len(PROMPT)
    ids = KVLending(dec).allocate_blocks(len(PROMPT))
    dec.runner.kv_cache[ids] = pre.runner.kv_cache[first.block_ids]
    KVLending(pre).release_prefilled("r")
    KVLending(dec).add_prefilled_request("r", PROMPT, first.token_ids, params, ids, len(PROMPT))
    rest = drain(dec)["r"]
    assert all(o.prompt_logprobs is None for o in rest)
    tokens = first.token_ids + [t for o in rest for t in o.new_token_ids]
    entries = first.logprobs + [e for o in rest for e in o.logprobs]
    ref = reference(hf, PROMPT + tokens)
    assert len(tokens) == 6
    for i, (entry, tok) in enumerate(zip(entries, tokens)):
        check(entry, ref[len(PROMPT) - 1 + i], tok, 2)
    for i in range(1, len(PROMPT)):
        check(first.prompt_logprobs[i], ref[i - 1], PROMPT[i], 1)
    for eng in (pre, dec):
        eng.check_integrity()
        assert eng.block_manager.num_used_blocks == 0


def test_logprobs_requests_do_not_speculate(model_dir, hf):
    llm = LLM(model=model_dir, dtype="float32", num_kv_blocks=128, block_size=4, max_model_len=200,
              speculative_method="suffix", speculative_adaptive=False)
    rng = random.Random(27)
    prompt = [rng.randrange(3, llm.engine.vocab_size) for _ in range(9)] * 3  # the tiny model then loops: drafts
    out = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=1))[0]
    assert llm.engine.spec_stats().num_drafted == 0
    ref = reference(hf, prompt + out.token_ids)
    for i, (entry, tok) in enumerate(zip(out.logprobs, out.token_ids)):
        check(entry, ref[len(prompt) - 1 + i], tok, 1)
    llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    assert llm.engine.spec_stats().num_drafted > 0  # the same prompt without logprobs does speculate
