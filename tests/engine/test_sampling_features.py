"""Penalties, biases and min-p (checked against transformers' logits processors or OpenAI's formula on the
same logits, and end to end against transformers' generate), their validation, and shared prefill."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                    SequenceBiasLogitsProcessor, TemperatureLogitsWarper)

from engine import LLM, InvalidRequestError, SamplingParams
from engine.logits_processing import apply_min_p, apply_penalties
from engine.sampler import row_probs, sample
from engine.request import Request

VOCAB = 300


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model=model_dir, dtype="float32", num_kv_blocks=160, block_size=16, max_model_len=400)


@pytest.fixture(scope="module")
def hf(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("kwargs,field", [
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-2.01), "frequency_penalty"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=2.5), "repetition_penalty"),
    (dict(min_p=-0.1), "min_p"),
    (dict(min_p=1.5), "min_p"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={5: 100.5}), "logit_bias"),
    (dict(logit_bias={"5": 1.0}), "logit_bias"),
    (dict(logit_bias={i: 1.0 for i in range(301)}), "logit_bias"),
    (dict(logprobs=21), "logprobs"),
    (dict(logprobs=True), "logprobs"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(structured="json"), "structured"),
])
def test_bad_feature_params_name_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError) as exc:
        SamplingParams(**kwargs)
    assert exc.value.field == field


def test_logit_bias_ids_checked_against_the_vocabulary(llm):
    eng = llm.engine
    with pytest.raises(InvalidRequestError) as exc:
        eng.add_request("bias", [5, 6], SamplingParams(logit_bias={eng.vocab_size: 1.0}))
    assert exc.value.field == "logit_bias" and not eng.has_unfinished_requests()


def _rows(seed: int = 0, n: int = 4) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, VOCAB, generator=g) * 4


def test_repetition_penalty_matches_transformers():
    logits = _rows()
    prompt, output = [3, 7, 7, 11, 200], [11, 42, 299, 0]
    for penalty in (0.5, 1.3, 2.0):
        ours = logits.clone()
        for r in range(ours.shape[0]):
            apply_penalties(ours[r], SamplingParams(repetition_penalty=penalty), prompt, output)
        ids = torch.tensor([prompt + output] * logits.shape[0])
        ref = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone())
        torch.testing.assert_close(ours, ref, rtol=0, atol=0)


def test_logit_bias_matches_transformers_sequence_bias():
    logits = _rows(1)
    bias = {4: 5.0, 17: -100.0, 250: 0.25}
    ours = logits.clone()
    for r in range(ours.shape[0]):
        apply_penalties(ours[r], SamplingParams(logit_bias=bias), [1, 2], [3])
    proc = SequenceBiasLogitsProcessor(sequence_bias=[[[t], b] for t, b in bias.items()])
    ref = proc(torch.tensor([[1, 2, 3]] * logits.shape[0]), logits.clone())
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-6)


def test_presence_and_frequency_penalties_follow_openai_formula():
    logits = _rows(2)[0]
    output = [5, 5, 5, 9, 100, 9]
    params = SamplingParams(presence_penalty=0.7, frequency_penalty=-1.25)
    ours = logits.clone()
    apply_penalties(ours, params, [5, 6, 7, 8], output)  # the prompt does not count (OpenAI)
    ref = logits.clone()
    for t in range(VOCAB):  # OpenAI: mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence
        c = output.count(t)
        ref[t] = ref[t] - c * params.frequency_penalty - float(c > 0) * params.presence_penalty
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-6)


def test_min_p_matches_transformers():
    logits = _rows(3)
    for min_p, temperature in ((0.05, 1.0), (0.3, 0.7), (1.0, 2.0)):
        ref = MinPLogitsWarper(min_p)(None, TemperatureLogitsWarper(temperature)(None, logits.clone()))
        for r in range(logits.shape[0]):
            ours = apply_min_p(logits[r] / temperature, min_p)
            assert torch.equal(torch.isinf(ours), torch.isinf(ref[r]))
            probs = row_probs(logits[r].clone(), SamplingParams(temperature=temperature, min_p=min_p))
            torch.testing.assert_close(probs, torch.softmax(ref[r], -1), rtol=1e-5, atol=1e-7)


def _generate(llm, prompt, **kw):
    return llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, **kw))[0].token_ids


def test_greedy_repetition_penalty_and_bias_equal_transformers_generate(llm, hf):
    prompt = [5, 17, 17, 99, 3, 5, 8]
    ids = torch.tensor([prompt])
    ref = hf.generate(ids, max_new_tokens=12, do_sample=False, repetition_penalty=1.8, pad_token_id=0,
                      eos_token_id=None)[0, len(prompt):].tolist()
    assert _generate(llm, prompt, repetition_penalty=1.8) == ref
    plain = _generate(llm, prompt)
    bias = {plain[0]: -100.0, 1234: 6.0}
    ref = hf.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None,
                      sequence_bias=[[[t], b] for t, b in bias.items()])[0, len(prompt):].tolist()
    ours = _generate(llm, prompt, logit_bias=bias)
    assert ours == ref and ours[0] != plain[0]


def test_greedy_presence_frequency_equal_a_reference_loop(llm, hf):
    prompt = [11, 12, 13, 11]
    params = dict(presence_penalty=1.5, frequency_penalty=0.9)
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            row = hf(torch.tensor([seq])).logits[0, -1].float()
            for t in set(seq[len(prompt):]):
                c = seq[len(prompt):].count(t)
                row[t] -= c * params["frequency_penalty"] + params["presence_penalty"]
            seq.append(int(row.argmax()))
    assert _generate(llm, prompt, **params) == seq[len(prompt):]


def test_plain_rows_skip_the_feature_paths():
    """Rows that ask for no extra never reach the penalty, grammar or logprob code."""
    boom = mock.Mock(side_effect=AssertionError("called for a plain row"))
    logits = _rows(4, 3)
    reqs = [Request(f"r{i}", [1, 2, 3], SamplingParams(temperature=0 if i else 1.0, seed=i)) for i in range(3)]
    with mock.patch("engine.sampler.apply_penalties", boom), mock.patch("engine.sampler.apply_masks", boom), \
            mock.patch("engine.sampler.raw_logprobs", boom), mock.patch("engine.sampler.apply_min_p", boom):
        result = sample(logits, reqs, frozenset())
    assert not result.errors and all(len(t) == 1 for t in result.token_ids) and result.logprobs is None


def test_a_failing_penalty_fails_only_its_request():
    logits = _rows(5, 2)
    reqs = [Request("bad", [1], SamplingParams(temperature=0, repetition_penalty=1.2)),
            Request("good", [1], SamplingParams(temperature=0))]
    with mock.patch("engine.sampler.apply_penalties", side_effect=RuntimeError("boom")):
        result = sample(logits, reqs, frozenset())
    assert list(result.errors) == [0] and "penalties" in result.errors[0]
    assert result.token_ids[1] == [int(logits[1].argmax())]


def _prompt_tokens_computed(eng) -> tuple[dict, int]:
    outs, computed = {}, 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
        computed += eng.last_step.num_prefill_tokens
        eng.check_integrity()
    return outs, computed


def test_shared_prefill_computes_common_blocks_once(llm):
    eng = llm.engine
    eng.block_manager.reset_prefix_cache()
    prompt = [(7 * i + 3) % 5000 + 10 for i in range(200)]
    # speculative=False: a seeded draw is reproducible across engine histories only without speculation
    # (rejection sampling keeps the distribution, not the draws), and this compares two histories.
    params = [SamplingParams(max_tokens=6, temperature=0 if i == 0 else 1.0, seed=i, speculative=False)
              for i in range(4)]
    for i, sp in enumerate(params):
        eng.add_request(f"s{i}", prompt, sp)
    shared, computed = _prompt_tokens_computed(eng)
    full = 199 // 16 * 16  # full blocks before the last prompt token
    assert computed == 200 + 3 * (200 - full)
    assert [shared[f"s{i}"].num_cached_tokens for i in range(4)] == [0, full, full, full]
    eng.block_manager.reset_prefix_cache()
    alone = [llm.generate([prompt], sp)[0].token_ids for sp in params]
    eng.block_manager.reset_prefix_cache()
    assert [shared[f"s{i}"].token_ids for i in range(4)] == alone


def test_shared_prefill_holds_back_only_the_sharing_requests(llm):
    eng = llm.engine
    eng.block_manager.reset_prefix_cache()
    prompt = list(range(100, 164))
    eng.add_request("a", prompt, SamplingParams(max_tokens=3, temperature=0))
    eng.add_request("b", prompt, SamplingParams(max_tokens=3, temperature=0))
    eng.add_request("other", list(range(300, 364)), SamplingParams(max_tokens=3, temperature=0))
    eng.step()
    assert sorted(r.request_id for r in eng.scheduler.running) == ["a", "other"]
    outs, _ = _prompt_tokens_computed(eng)
    assert outs["a"].token_ids == outs["b"].token_ids and outs["b"].num_cached_tokens == 48
    eng.block_manager.reset_prefix_cache()
