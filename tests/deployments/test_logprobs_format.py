"""The pure parts of logprobs, echo and n at the doors, with SmolLM2's real tokenizer and a scripted
backend (no engine, no server): OpenAI's logprobs shapes, token bytes, text offsets, the fan-out of n
samples and batched prompts (ids, seeds, merged chunks, usage, failures), echo and score-only choices."""

from __future__ import annotations

import asyncio
import math
from typing import AsyncIterator

import pytest
import torch
from transformers import AutoTokenizer

from deployments.frontend.backend import TokenDelta
from deployments.frontend.fanout import FanOut, sibling_seed
from deployments.frontend.logprobs_format import (
    MIN_LOGPROB, CompletionLogprobsBuilder, TokenText, chat_logprobs, merge_completion_logprobs)
from deployments.frontend.openai_choices import ChoiceFormatter, ChoiceOptions
from deployments.frontend.openai_protocol import APIError, ChatCompletionRequest, CompletionRequest
from deployments.frontend.prepare import PromptInput, PromptKind, SamplingInput, ServedModel, prepare
from deployments.frontend.text_stream import GenerationFailed
from engine import SamplingParams
from engine.model_loader import resolve_model_dir
from engine.request import TokenLogprob
from engine.sampling_params import SEED_MAX


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model_dir(None, torch.float32))


def lp(token_id: int, value: float, top: list[tuple[int, float]] | None = None) -> TokenLogprob:
    return TokenLogprob(token_id, value, top or [])


# ---------------------------------------------------------------------- token text and bytes
def test_token_bytes_rebuild_multibyte_text(tokenizer):
    texts = TokenText(tokenizer)
    text = "Grüße 🎉 café"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(texts.get(t)[1] for t in ids) == text.encode("utf-8")
    shown = [texts.text(t) for t in ids]
    partial = [s for s in shown if s.startswith("bytes:")]
    assert partial, shown  # the emoji spans several tokens, none of them whole UTF-8 alone
    assert all(s.startswith("bytes:\\x") for s in partial)
    assert texts.text(tokenizer.eos_token_id) == tokenizer.decode([tokenizer.eos_token_id])


def test_completion_logprobs_shape_offsets_and_nulls(tokenizer):
    texts = TokenText(tokenizer)
    ids = tokenizer.encode("The capital of France", add_special_tokens=False)
    builder = CompletionLogprobsBuilder(texts)
    entries = [None] + [lp(t, -1.5, [(t, -1.5), (ids[0], -2.0)]) for t in ids[1:]]
    first = builder.add(ids[:2], entries[:2])
    rest = builder.add(ids[2:], entries[2:])  # offsets continue across chunks
    whole = merge_completion_logprobs([first, rest])
    assert whole.tokens == [texts.text(t) for t in ids]
    assert whole.token_logprobs[0] is None and whole.top_logprobs[0] is None
    assert whole.token_logprobs[1:] == [-1.5] * (len(ids) - 1)
    assert whole.text_offset == [sum(len(s) for s in whole.tokens[:i]) for i in range(len(ids))]
    assert "".join(whole.tokens) == "The capital of France"
    assert whole.top_logprobs[1] == {texts.text(ids[1]): -1.5, texts.text(ids[0]): -2.0}
    # The chosen token is in top_logprobs even when it is not among the alternatives (vLLM's shape).
    odd = CompletionLogprobsBuilder(texts).add([ids[1]], [lp(ids[1], -7.0, [(ids[0], -0.1)])])
    assert odd.top_logprobs[0] == {texts.text(ids[0]): -0.1, texts.text(ids[1]): -7.0}


def test_logprobs_are_finite_json(tokenizer):
    texts = TokenText(tokenizer)
    out = CompletionLogprobsBuilder(texts).add([5], [lp(5, -math.inf, [(6, -math.inf)])])
    assert out.token_logprobs == [MIN_LOGPROB] and out.top_logprobs == [{texts.text(6): MIN_LOGPROB,
                                                                          texts.text(5): MIN_LOGPROB}]
    assert "Infinity" not in out.model_dump_json() and "null" not in out.model_dump_json()


def test_chat_logprobs_shape(tokenizer):
    texts = TokenText(tokenizer)
    ids = tokenizer.encode(" Paris 🎉", add_special_tokens=False)
    out = chat_logprobs(texts, ids, [lp(t, -0.25, [(t, -0.25), (504, -3.0)]) for t in ids])
    d = out.model_dump()["content"]
    assert [e["token"] for e in d] == [texts.text(t) for t in ids]
    assert bytes(b for e in d for b in e["bytes"]) == " Paris 🎉".encode()
    assert all(e["logprob"] == -0.25 and len(e["top_logprobs"]) == 2 for e in d)
    assert d[0]["top_logprobs"][1] == {"token": texts.text(504), "logprob": -3.0, "bytes": list(texts.get(504)[1])}


# ---------------------------------------------------------------------- request fields
def test_request_fields_map_to_sampling_input():
    c = CompletionRequest(prompt=["a", "b"], n=3, logprobs=2, echo=True, max_tokens=0, seed=7,
                          logit_bias={"12": -100, "7": 2.5}, presence_penalty=0.5, repetition_penalty=1.2)
    assert c.score_only and len(c.prompt_inputs()) == 2
    s = c.sampling_input()
    assert (s.max_tokens, s.logprobs, s.prompt_logprobs, s.logit_bias) == (1, 2, 2, {12: -100, 7: 2.5})
    assert (s.presence_penalty, s.repetition_penalty, s.frequency_penalty) == (0.5, 1.2, None)
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], logprobs=True)
    assert chat.sampling_input().logprobs == 0
    assert ChatCompletionRequest(messages=[{"role": "user", "content": "x"}]).sampling_input().logprobs is None


@pytest.mark.parametrize("body,param", [
    (dict(prompt="a", n=17), "n"), (dict(prompt="a", n=0), "n"), (dict(prompt=["a"] * 65), "prompt"),
    (dict(prompt=["a"] * 20, n=8), "n"), (dict(prompt=["a", ""]), "prompt"),
    (dict(prompt="a", logit_bias={"x1": 1.0}), "logit_bias"), (dict(prompt="a", logit_bias={"-1": 1.0}), "logit_bias"),
    (dict(prompt="a", echo=True, max_tokens=0, min_tokens=1), "min_tokens"),
])
def test_completion_request_bounds(body, param):
    with pytest.raises(APIError) as e:
        req = CompletionRequest(**body)
        req.prompt_inputs()
        req.sampling_input()
    assert e.value.param == param and e.value.status_code == 400


@pytest.mark.parametrize("body", [dict(top_logprobs=2), dict(logprobs=True, top_logprobs=21),
                                  dict(logprobs=True, top_logprobs=-1)])
def test_chat_top_logprobs_bounds(body):
    with pytest.raises(APIError) as e:
        ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **body).sampling_input()
    assert e.value.param == "top_logprobs"


def test_sibling_seeds():
    assert [sibling_seed(5, i) for i in range(3)] == [5, 6, 7]
    assert sibling_seed(None, 3) is None
    assert sibling_seed(SEED_MAX, 2) == 1  # wraps modulo 2**64, within the engine's range
    assert sibling_seed(-3, 2) == -1


# ---------------------------------------------------------------------- fan-out over a scripted backend
class ScriptedBackend:
    """Each request yields its own id's tokens: [100 + k] * 3 for request "...-k", with logprobs."""

    def __init__(self, fail: str | None = None):
        self.calls: list[tuple[str, list[int], SamplingParams]] = []
        self.aborted: list[str] = []
        self.fail = fail

    async def generate(self, request_id, prompt_token_ids, params, priority=0, cache_salt=None
                       ) -> AsyncIterator[TokenDelta]:
        self.calls.append((request_id, list(prompt_token_ids), params))
        tail = request_id.rsplit("-", 1)[1]
        k = int(tail) if tail.isdigit() else 0
        asked = params.prompt_logprobs is not None
        prompt_lps = [None] + [lp(t, -1.0) for t in prompt_token_ids[1:]] if asked else None
        for step in range(params.max_tokens):
            await asyncio.sleep(0.001 * (k + 1))
            if request_id == self.fail and step == 1:
                yield TokenDelta([], True, "error", "boom", len(prompt_token_ids))
                return
            last = step == params.max_tokens - 1
            yield TokenDelta([100 + k], last, "length" if last else None, None, len(prompt_token_ids), 0,
                             [lp(100 + k, -0.5 - k)] if params.logprobs is not None else None,
                             prompt_lps if step == 0 else None)

    async def abort(self, request_id):
        self.aborted.append(request_id)

    async def health(self):
        return {"status": "ok"}


def _prepared(tokenizer, prompts, **sampling):
    model = ServedModel.of("m", tokenizer, 128)
    return [prepare(model, PromptInput(PromptKind.TEXT, p), SamplingInput(**sampling)) for p in prompts]


def test_fanout_ids_seeds_merge_and_usage(tokenizer):
    backend = ScriptedBackend()
    prepared = _prepared(tokenizer, ["Hello there", "Hi"], max_tokens=3, seed=11, logprobs=1)
    fan = FanOut(backend, "cmpl-x", prepared, 2, tokenizer)

    async def run():
        await fan.start()
        return [c async for c in fan.chunks()]

    chunks = asyncio.run(run())
    assert [c[0] for c in backend.calls] == ["cmpl-x-0", "cmpl-x-1", "cmpl-x-2", "cmpl-x-3"]
    assert [c[2].seed for c in backend.calls] == [11, 12, 11, 12]
    assert [len(c[1]) for c in backend.calls] == [2, 2, 1, 1]
    for k in range(4):
        mine = [c for c in chunks if c.index == k]
        assert sum((c.token_ids for c in mine), []) == [100 + k] * 3
        assert [x.logprob for c in mine for x in c.logprobs] == [-0.5 - k] * 3
        assert mine[-1].finish_reason == "length"
    assert len({c.index for c in chunks[:4]}) > 1  # interleaved as they arrive, not one choice after another
    assert fan.usage == (3, 12, 0)  # each prompt once, every choice's tokens
    assert fan.finish_reasons == ["length"] * 4


def test_fanout_lone_choice_keeps_the_request_id(tokenizer):
    backend = ScriptedBackend()
    fan = FanOut(backend, "cmpl-y", _prepared(tokenizer, ["Hi"], max_tokens=2), 1, tokenizer)

    async def run():
        await fan.start()
        return [c async for c in fan.chunks()]

    assert [c.index for c in asyncio.run(run())] == [0, 0]
    assert [c[0] for c in backend.calls] == ["cmpl-y"]


def test_fanout_one_failure_fails_the_request_and_aborts_the_rest(tokenizer):
    backend = ScriptedBackend(fail="cmpl-z-0")
    fan = FanOut(backend, "cmpl-z", _prepared(tokenizer, ["Hi"], max_tokens=50), 3, tokenizer)

    async def run():
        await fan.start()
        try:
            async for _ in fan.chunks():
                pass
        finally:
            await fan.close()

    with pytest.raises(GenerationFailed):
        asyncio.run(run())
    assert set(backend.aborted) == {"cmpl-z-1", "cmpl-z-2"}


def test_echo_and_score_only_choices(tokenizer):
    backend = ScriptedBackend()
    req = CompletionRequest(prompt=["The sky is", "Hi"], echo=True, max_tokens=0, logprobs=1)
    prompts = req.prompt_inputs()
    model = ServedModel.of("m", tokenizer, 128)
    prepared = [prepare(model, p, req.sampling_input()) for p in prompts]
    fan = FanOut(backend, "cmpl-e", prepared, 1, tokenizer, score_only=True)
    fmt = ChoiceFormatter(fan, tokenizer, ChoiceOptions(chat=False, logprobs=True,
                                                        echo_texts=[p.value for p in prompts]))

    async def run():
        await fan.start()
        return [c async for c in fan.chunks()]

    choices = fmt.completion_choices(asyncio.run(run()))
    assert [c.text for c in choices] == ["The sky is", "Hi"]
    assert [c.finish_reason for c in choices] == ["length", "length"]
    first = choices[0].logprobs
    ids = prepared[0].prompt_token_ids
    assert first.tokens == [TokenText(tokenizer).text(t) for t in ids]
    assert first.token_logprobs == [None] + [-1.0] * (len(ids) - 1)
    assert fan.usage.num_completion_tokens == 0 and fan.usage.num_prompt_tokens == len(ids) + 1
