"""The request preparation and the text stream both doors share, driven directly with SmolLM2's real
tokenizer (no engine, no server): exact token ids, defaults, error fields, and stop-string aborts."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch
from transformers import AutoTokenizer

from deployments.frontend.backend import TokenDelta
from deployments.frontend.prepare import (
    DEFAULT_MAX_TOKENS, PromptInput, PromptKind, SamplingInput, ServedModel, UnknownModelError, prepare)
from deployments.frontend.text_stream import GenerationFailed, TextChunk, TextStream
from engine import InvalidRequestError, PromptTooLongError, SamplingParams
from engine.model_loader import resolve_model_dir

MAX_MODEL_LEN = 64
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model_dir(None, torch.float32))


@pytest.fixture(scope="module")
def model(tokenizer) -> ServedModel:
    return ServedModel.of("smollm2", tokenizer, MAX_MODEL_LEN)


def test_three_prompt_forms(model, tokenizer):
    text = prepare(model, PromptInput(PromptKind.TEXT, "Hello there"), SamplingInput())
    ids = tokenizer.encode("Hello there", add_special_tokens=False)
    assert text.prompt_token_ids == ids
    assert prepare(model, PromptInput(PromptKind.TOKEN_IDS, ids), SamplingInput()).prompt_token_ids == ids
    chat = prepare(model, PromptInput(PromptKind.CHAT, FRANCE, "messages"), SamplingInput())
    templated = tokenizer.apply_chat_template(FRANCE, add_generation_prompt=True, tokenize=True)
    assert chat.prompt_token_ids == list(templated if isinstance(templated, list) else templated["input_ids"])
    # Omitted max_tokens: DEFAULT_MAX_TOKENS for text and ids, the rest of the context for chat.
    assert text.params.max_tokens == DEFAULT_MAX_TOKENS
    assert chat.params.max_tokens == MAX_MODEL_LEN - len(chat.prompt_token_ids)


def test_sampling_defaults_and_values(model):
    defaults = prepare(model, PromptInput(PromptKind.TEXT, "hi"), SamplingInput()).params
    assert defaults == SamplingParams(max_tokens=DEFAULT_MAX_TOKENS)
    given = prepare(model, PromptInput(PromptKind.TEXT, "hi"), SamplingInput(
        max_tokens=5, temperature=0.0, top_p=0.5, top_k=7, seed=3, stop="END", stop_token_ids=[2],
        ignore_eos=True, min_tokens=1)).params
    assert given == SamplingParams(max_tokens=5, temperature=0.0, top_p=0.5, top_k=7, seed=3, stop=["END"],
                                   stop_token_ids=[2], ignore_eos=True, min_tokens=1)


def test_vocabulary_bound_comes_from_the_served_model(tokenizer):
    assert ServedModel.of("m", tokenizer, MAX_MODEL_LEN).vocab_size == len(tokenizer)
    small = ServedModel.of("m", tokenizer, MAX_MODEL_LEN, vocab_size=100)
    assert prepare(small, PromptInput(PromptKind.TOKEN_IDS, [99]), SamplingInput()).prompt_token_ids == [99]
    with pytest.raises(InvalidRequestError) as e:
        prepare(small, PromptInput(PromptKind.TOKEN_IDS, [100], "prompt_token_ids"), SamplingInput())
    assert (e.value.field, e.value.message) == ("prompt_token_ids", "token ids must be in [0, 100)")


@pytest.mark.parametrize("prompt, sampling, error, field", [
    (PromptInput(PromptKind.TEXT, ""), SamplingInput(), InvalidRequestError, "prompt"),
    (PromptInput(PromptKind.TOKEN_IDS, [-1]), SamplingInput(), InvalidRequestError, "prompt"),
    (PromptInput(PromptKind.TOKEN_IDS, [5] * MAX_MODEL_LEN), SamplingInput(), PromptTooLongError, "prompt"),
    (PromptInput(PromptKind.CHAT, [{"role": "user", "content": "hi " * 200}], "messages"), SamplingInput(),
     PromptTooLongError, "messages"),
    (PromptInput(PromptKind.TEXT, "hi"), SamplingInput(max_tokens=MAX_MODEL_LEN), PromptTooLongError, "max_tokens"),
    (PromptInput(PromptKind.CHAT, FRANCE, "messages"),
     SamplingInput(max_tokens=0, max_tokens_field="max_completion_tokens"), InvalidRequestError,
     "max_completion_tokens"),
    (PromptInput(PromptKind.TEXT, "hi"), SamplingInput(temperature=-1), InvalidRequestError, "temperature"),
    (PromptInput(PromptKind.TEXT, "hi"), SamplingInput(max_tokens=2, min_tokens=3), InvalidRequestError,
     "min_tokens"),
])
def test_errors_name_the_request_field(model, prompt, sampling, error, field):
    with pytest.raises(error) as e:
        prepare(model, prompt, sampling)
    assert e.value.field == field, e.value


def test_model_name_check(model):
    assert model.check_name(None) == model.check_name("smollm2") == "smollm2"
    with pytest.raises(UnknownModelError) as e:
        model.check_name("gpt-17")
    assert e.value.field == "model" and "gpt-17" in e.value.message


class _ScriptedBackend:
    """Yields `deltas` in order and records aborts: what the text stream does with them is the test."""

    def __init__(self, deltas: list[TokenDelta]):
        self.deltas = deltas
        self.aborted: list[str] = []

    async def generate(self, request_id, prompt_token_ids, params, priority=0):
        for d in self.deltas:
            yield d

    async def abort(self, request_id):
        self.aborted.append(request_id)

    async def health(self):
        return {"status": "ok"}


def _run(tokenizer, deltas: list[TokenDelta], stop: list[str]) -> tuple[list[TextChunk], _ScriptedBackend, TextStream]:
    backend = _ScriptedBackend(deltas)
    stream = TextStream(backend, "r1", [1, 2, 3], SamplingParams(max_tokens=50, stop=stop), 0, tokenizer)

    async def go() -> list[TextChunk]:
        try:
            await stream.start()
            return [c async for c in stream.chunks()]
        finally:
            await stream.close()

    return asyncio.run(go()), backend, stream


def test_text_stream_stop_string_aborts_and_counts(tokenizer):
    ids = tokenizer.encode("one two three four five", add_special_tokens=False)
    chunks, backend, stream = _run(tokenizer, [TokenDelta([t]) for t in ids], stop=[" three"])
    assert "".join(c.text for c in chunks) == "one two"
    assert chunks[-1].finish_reason == "stop" and all(c.finish_reason is None for c in chunks[:-1])
    assert backend.aborted == ["r1"]  # the stream was still running when the stop string showed up
    assert stream.usage == (3, sum(len(c.token_ids) for c in chunks), 0)


def test_text_stream_finished_and_failed(tokenizer):
    ids = tokenizer.encode("Hello world", add_special_tokens=False)
    chunks, backend, _ = _run(tokenizer, [TokenDelta(ids[:1]), TokenDelta(ids[1:], True, "length")], stop=[])
    assert "".join(c.text for c in chunks) == "Hello world" and chunks[-1].finish_reason == "length"
    assert backend.aborted == []  # finished: nothing to abort
    with pytest.raises(GenerationFailed, match="worker died"):
        _run(tokenizer, [TokenDelta(ids[:1]), TokenDelta([], True, "error", "worker died")], stop=[])
    with pytest.raises(GenerationFailed, match="ended before the request finished"):
        _run(tokenizer, [TokenDelta(ids[:1])], stop=[])


# ---------------------------------------------------------------------- bounds only a door knows
@pytest.mark.parametrize("kwargs, field", [
    (dict(priority=2**31), "priority"),
    (dict(priority=-2**31 - 1), "priority"),
    (dict(priority=True), "priority"),
    (dict(cache_salt=""), "cache_salt"),
    (dict(cache_salt="s" * 1025), "cache_salt"),
    (dict(cache_salt="\ud800"), "cache_salt"),
    (dict(sampling=SamplingInput(stop_token_ids=[49152])), "stop_token_ids"),
    (dict(sampling=SamplingInput(stop=["ok", "a\udfffb"])), "stop"),
    (dict(prompt=PromptInput(PromptKind.TEXT, "hi \ud83d")), "prompt"),
    (dict(prompt=PromptInput(PromptKind.CHAT, [{"role": "user", "content": "\udc00"}], "messages")), "messages"),
    (dict(prompt=PromptInput(PromptKind.TOKEN_IDS, [1, True])), "prompt"),
])
def test_door_bounds(model, kwargs, field):
    prompt = kwargs.pop("prompt", PromptInput(PromptKind.TEXT, "hi"))
    sampling = kwargs.pop("sampling", SamplingInput())
    with pytest.raises(InvalidRequestError) as e:
        prepare(model, prompt, sampling, **kwargs)
    assert e.value.field == field, e.value


def test_priority_and_cache_salt_are_carried(model):
    model = dataclasses.replace(model, scheduling_policy="priority")  # under "fcfs" a priority is refused
    prompt = PromptInput(PromptKind.TEXT, "hi")
    edge = prepare(model, prompt, SamplingInput(stop_token_ids=[len(model.tokenizer) - 1]), priority=-2**31,
                   cache_salt="s" * 1024)
    assert (edge.priority, edge.cache_salt) == (-2**31, "s" * 1024)
    assert prepare(model, prompt, SamplingInput()).cache_salt is None


def test_long_prompts_are_prepared_off_the_event_loop_with_the_same_result(model):
    from deployments.frontend import prepare as prepare_module

    long_text = "word " * (prepare_module.INLINE_PREPARE_CHARS // 5 + 1)
    for text in ("short", long_text):
        prompt = PromptInput(PromptKind.TEXT, text)
        sampling = SamplingInput(max_tokens=2)
        if len(text) > MAX_MODEL_LEN:
            with pytest.raises(PromptTooLongError):
                asyncio.run(prepare_module.prepare_off_loop(model, prompt, sampling))
        else:
            assert asyncio.run(prepare_module.prepare_off_loop(model, prompt, sampling)) == prepare(model, prompt,
                                                                                                  sampling)


# ---------------------------------------------------------------------- nothing left running
class _SubmitBackend(_ScriptedBackend):
    """`generate` awaits a slow "submit" first, as the router backend does; `abort` may fail."""

    def __init__(self, deltas, submit_s: float = 10.0, abort_fails: bool = False):
        super().__init__(deltas)
        self.submit_s = submit_s
        self.abort_fails = abort_fails
        self.salt: str | None = None

    async def generate(self, request_id, prompt_token_ids, params, priority=0, cache_salt=None):
        self.salt = cache_salt
        await asyncio.sleep(self.submit_s)
        for d in self.deltas:
            yield d

    async def abort(self, request_id):
        self.aborted.append(request_id)
        if self.abort_fails:
            raise RuntimeError("router gone")


def _stream(backend, salt=None) -> TextStream:
    return TextStream(backend, "r1", [1, 2, 3], SamplingParams(max_tokens=5), 0, _NoTokenizer(), salt)


class _NoTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


def test_cancelled_during_submit_aborts_once():
    backend = _SubmitBackend([TokenDelta([1], True, "length")])

    async def go():
        stream = _stream(backend, salt="t1")
        task = asyncio.create_task(stream.start())
        await asyncio.sleep(0.05)  # inside the backend's submit
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await stream.close()
        await stream.close()  # idempotent

    asyncio.run(go())
    assert backend.aborted == ["r1"] and backend.salt == "t1"


def test_never_started_or_refused_streams_abort_nothing():
    from deployments.frontend.backend import QueueFullError

    backend = _SubmitBackend([], submit_s=0)

    async def go():
        await _stream(backend).close()  # built, never started: nothing was submitted

        class Refusing(_SubmitBackend):
            async def generate(self, *a, **k):
                raise QueueFullError("busy")
                yield

        refusing = Refusing([])
        stream = _stream(refusing)
        with pytest.raises(QueueFullError):
            await stream.start()
        await stream.close()
        return refusing

    refusing = asyncio.run(go())
    assert backend.aborted == [] and refusing.aborted == []


def test_a_failing_abort_still_closes_the_stream():
    backend = _SubmitBackend([TokenDelta([1]), TokenDelta([2])], submit_s=0, abort_fails=True)

    async def go():
        stream = _stream(backend)
        await stream.start()
        await stream.close()  # the abort raises inside; close does not
        return stream

    asyncio.run(go())
    assert backend.aborted == ["r1"]
