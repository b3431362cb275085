"""Request preparation that both doors share: prompt → token ids, sampling values → `SamplingParams`.

    HTTP body ─┐                                                    ┌─▶ (prompt_token_ids, SamplingParams)
               ├─▶ PromptInput + SamplingInput ─▶ prepare(model, ...) ┤
    gRPC msg  ─┘                                                    └─▶ InvalidRequestError (field, message)

Each door turns its own request into the two neutral inputs and maps the one error type to its own
answer: HTTP an OpenAI error object (400; `PromptTooLongError` → code `context_length_exceeded`,
`UnknownModelError` → 404), gRPC INVALID_ARGUMENT (NOT_FOUND for the model). Errors name the field
as the client spelled it (`messages`, `max_completion_tokens`, `prompt_token_ids`, ...).

Bounds: the sampling values' are SamplingParams' own (engine/sampling_params.py), checked once
there; what only a door knows is checked here: token ids against the served vocabulary (prompt and
`stop_token_ids`), text free of lone surrogates, `priority` within PRIORITY_RANGE (and 0 unless the
server's scheduling_policy is "priority"), `cache_salt`
(the engine's `check_cache_salt`: 1..1024 characters). docs/reference/api.md lists them all.

Defaults for an omitted `max_tokens` follow vLLM: DEFAULT_MAX_TOKENS for a text or token-id prompt
(OpenAI's documented default for the legacy completions endpoint) and "the rest of the context"
(`max_model_len - prompt tokens`) for chat. An explicit value that does not fit the context is an
error (`PromptTooLongError`), as with OpenAI and vLLM, rather than being silently cut.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from deployments.frontend.prompt_input import PromptInput, PromptKind  # noqa: F401 - re-exported
from deployments.frontend.tool_calls import check_chat_template
from engine import InvalidRequestError, PromptTooLongError, SamplingParams
from engine.sampling_params import check_cache_salt
from engine.structured import StructuredSpec

# Omitted max_tokens for a text or token-id prompt; chat gets the rest of the context instead.
DEFAULT_MAX_TOKENS = 16
# `priority` (lower runs first) is a 32-bit integer at both doors: gRPC's field is an int32.
PRIORITY_RANGE = (-(1 << 31), (1 << 31) - 1)


class UnknownModelError(InvalidRequestError):
    """The request names a model this server does not serve (HTTP 404, gRPC NOT_FOUND)."""


@dataclass(frozen=True, slots=True)
class ServedModel:
    """What preparation needs to know about the served model; one per replica.

    vocab_size: token ids a client sends must lie in [0, vocab_size). The model's own vocabulary
    (its embedding rows) when the builder knows it, else the tokenizer's size: see `of`.
    """

    name: str
    tokenizer: Any  # a transformers tokenizer: encode, apply_chat_template, len()
    max_model_len: int
    vocab_size: int
    scheduling_policy: str = "fcfs"  # the engines' (EngineConfig.scheduling_policy): "fcfs" refuses a priority

    @classmethod
    def of(cls, name: str, tokenizer: Any, max_model_len: int, vocab_size: int | None = None,
           scheduling_policy: str = "fcfs") -> ServedModel:
        """The one place the token-id bound is chosen: `vocab_size` if given, else `len(tokenizer)`."""
        return cls(name, tokenizer, max_model_len, len(tokenizer) if vocab_size is None else vocab_size,
                   scheduling_policy)

    def check_name(self, requested: str | None) -> str:
        """The served name; raises `UnknownModelError` if `requested` is given and names another model."""
        if requested is not None and requested != self.name:
            shown = requested if len(requested) <= 64 else requested[:64] + "..."  # never echo a megabyte
            raise UnknownModelError("model", f"`{shown}` does not exist; this server serves `{self.name}`")
        return self.name


@dataclass(frozen=True, slots=True)
class SamplingInput:
    """Sampling values as the client sent them; None: not sent, the default applies."""

    max_tokens: int | None = None
    max_tokens_field: str = "max_tokens"  # chat's newer name is max_completion_tokens
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int | None = None
    speculative: bool = True  # False: this request never carries speculative drafts
    # Penalties, bias and logprobs: passed to SamplingParams under the same names when set.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    logit_bias: dict[int, float] | None = None  # token id -> bias; ids checked against the vocabulary
    logprobs: int | None = None  # per generated token: its logprob and this many alternatives
    prompt_logprobs: int | None = None  # the same per prompt token (the first has none)
    structured: StructuredSpec | None = None  # the output constraint (structured_request.py, tool_calls.py)


# SamplingInput fields that go to SamplingParams as they are when set (unset: the engine's default).
_PASSED_WHEN_SET = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "logit_bias",
                    "logprobs", "prompt_logprobs", "structured")


class PreparedRequest(NamedTuple):
    """A request every check has passed: what the backend's `generate` takes."""

    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0  # lower runs first
    cache_salt: str | None = None  # prefix-cache entries are shared only between requests with the same salt
    tenant: str | None = None  # the API key's tenant (tenants.py); None: no tenants configured
    tenant_weight: float = 1.0


def prepare(model: ServedModel, prompt: PromptInput, sampling: SamplingInput, priority: int = 0,
            cache_salt: str | None = None) -> PreparedRequest:
    """Validate and convert one request; raises `InvalidRequestError` (or `PromptTooLongError`)."""
    if not isinstance(priority, int) or isinstance(priority, bool) or \
            not PRIORITY_RANGE[0] <= priority <= PRIORITY_RANGE[1]:
        raise InvalidRequestError("priority", "must be an integer in [-2**31, 2**31 - 1]")
    if priority and model.scheduling_policy == "fcfs":  # never accepted and ignored
        raise InvalidRequestError("priority", "this server schedules first come, first served "
                                              "(scheduling_policy=fcfs): leave priority at 0")
    check_cache_salt(cache_salt)  # the engine's bound, checked again by the engine that runs it
    if cache_salt is not None:
        check_text("cache_salt", cache_salt)
    prompt_ids = prompt_token_ids(model, prompt)
    params = _sampling_params(model, prompt, len(prompt_ids), sampling)
    return PreparedRequest(prompt_ids, params, priority, cache_salt)


def _sampling_params(model: ServedModel, prompt: PromptInput, num_prompt_tokens: int,
                     sampling: SamplingInput) -> SamplingParams:
    max_tokens = _max_tokens(model, prompt, num_prompt_tokens, sampling)
    for stop in [sampling.stop] if isinstance(sampling.stop, str) else sampling.stop or []:
        if isinstance(stop, str):
            check_text("stop", stop)
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if sampling.temperature is None else sampling.temperature,
            top_p=1.0 if sampling.top_p is None else sampling.top_p,
            top_k=-1 if sampling.top_k is None else sampling.top_k,
            seed=sampling.seed,
            stop=[] if sampling.stop is None else sampling.stop,
            stop_token_ids=list(sampling.stop_token_ids),
            ignore_eos=sampling.ignore_eos,
            min_tokens=0 if sampling.min_tokens is None else sampling.min_tokens,
            speculative=sampling.speculative,
            **{name: getattr(sampling, name) for name in _PASSED_WHEN_SET if getattr(sampling, name) is not None},
        )
        params.check_token_ids(model.vocab_size)
    except InvalidRequestError as e:
        if e.field != "max_tokens":
            raise
        raise type(e)(sampling.max_tokens_field, e.message) from None
    return params


def check_text(field_name: str, text: str) -> None:
    """Text must be valid Unicode: a lone surrogate (JSON's "\\ud800") cannot be tokenized or sent back."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequestError(field_name, "must be valid Unicode text (it holds a lone surrogate)") from None


def prompt_token_ids(model: ServedModel, prompt: PromptInput) -> list[int]:
    """The prompt's token ids, never empty; raises `InvalidRequestError` naming `prompt.field`."""
    tokenizer = model.tokenizer
    if prompt.kind is PromptKind.TEXT:
        check_text(prompt.field, prompt.value)
        ids = list(tokenizer.encode(prompt.value, add_special_tokens=False))
    elif prompt.kind is PromptKind.TOKEN_IDS:
        ids = list(prompt.value)
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < model.vocab_size for t in ids):
            raise InvalidRequestError(prompt.field, f"token ids must be in [0, {model.vocab_size})")
    else:
        for message in prompt.value:
            for text in message.values():
                if isinstance(text, str):
                    check_text(prompt.field, text)
        prompt = check_chat_template(tokenizer, prompt)  # tools need a template that renders them
        tools = {} if prompt.tools is None else {"tools": prompt.tools}
        try:
            out = tokenizer.apply_chat_template(prompt.value, add_generation_prompt=True, tokenize=True, **tools)
        except Exception as e:  # jinja's raise_exception (roles must alternate, ...), no template
            raise InvalidRequestError(prompt.field, f"the chat template rejected them: {str(e)[:200]}") from None
        ids = list(out if isinstance(out, list) else out["input_ids"])
    if not ids:
        raise InvalidRequestError(prompt.field, "encodes to no tokens")
    return ids


def _max_tokens(model: ServedModel, prompt: PromptInput, num_prompt_tokens: int, sampling: SamplingInput) -> int:
    limit = model.max_model_len
    if num_prompt_tokens >= limit:
        raise PromptTooLongError(prompt.field, f"{num_prompt_tokens} tokens, but this model's maximum context "
                                               f"length is {limit} tokens including at least one generated "
                                               f"token; shorten it")
    remaining = limit - num_prompt_tokens
    if sampling.max_tokens is None:
        return remaining if prompt.kind is PromptKind.CHAT else min(DEFAULT_MAX_TOKENS, remaining)
    if isinstance(sampling.max_tokens, int) and sampling.max_tokens > remaining:
        raise PromptTooLongError(sampling.max_tokens_field,
                                 f"{sampling.max_tokens} is too large; this model's maximum context length is "
                                 f"{limit} tokens and the prompt has {num_prompt_tokens}, so at most "
                                 f"{remaining} can be generated")
    return sampling.max_tokens


# Prompts longer than this (characters, or ids) are prepared on a worker thread.
INLINE_PREPARE_CHARS = 16384


def prepare_size(prompt: PromptInput, sampling: SamplingInput) -> int:
    """Roughly how much text `prepare` renders, tokenizes or parses: every field of every message
    (content, role, name, tool calls: whichever is large), the prompt, the output constraint."""
    value = prompt.value
    if prompt.kind is PromptKind.CHAT:
        size = sum(len(v) if isinstance(v, str) else len(str(v)) for m in value for v in m.values())
    else:
        size = len(value)
    structured = getattr(sampling, "structured", None)
    return size + (len(structured.value) if structured is not None else 0)


async def prepare_off_loop(model: ServedModel, prompt: PromptInput, sampling: SamplingInput, priority: int = 0,
                           cache_salt: str | None = None) -> PreparedRequest:
    """`prepare`, on a worker thread when the prompt is long. NOTE: tokenizing a few MiB takes seconds;
    the tokenizer releases the GIL, so the event loop keeps serving every other stream meanwhile."""
    size = prepare_size(prompt, sampling)
    if size <= INLINE_PREPARE_CHARS:
        return prepare(model, prompt, sampling, priority, cache_salt)
    return await asyncio.to_thread(prepare, model, prompt, sampling, priority, cache_salt)
