"""The OpenAI HTTP schema (pydantic v2): requests, responses, stream chunks, error objects.

Pydantic lives only here, at the HTTP edge. A request's `prompt_input()` and `sampling_input()`
check what only the OpenAI schema has (n, batches, content parts, ...) and hand the rest to
the protocol-neutral preparation (deployments/frontend/prepare.py, which also holds the max_tokens
defaults). Which top-level fields are taken at all: openai_fields.py. Every user error becomes an
`APIError` that the HTTP app answers with `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from deployments.frontend.prepare import PromptInput, PromptKind, SamplingInput
from engine import InvalidRequestError, PromptTooLongError


# ---------------------------------------------------------------------- errors
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class APIError(Exception):
    """An error answered to the client as an OpenAI error object with `status_code`."""

    def __init__(self, status_code: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def to_response(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code))

    @classmethod
    def bad_request(cls, message: str, param: str | None = None, code: str | None = None) -> APIError:
        return cls(400, message, "invalid_request_error", param, code)

    @classmethod
    def from_invalid(cls, e: InvalidRequestError, rename: dict[str, str] | None = None) -> APIError:
        """400 from an engine `InvalidRequestError`; its field becomes `param` (renamed per `rename`)."""
        param = (rename or {}).get(e.field, e.field)
        code = "context_length_exceeded" if isinstance(e, PromptTooLongError) else "invalid_value"
        return cls.bad_request(f"{param}: {e.message}", param, code)


# ---------------------------------------------------------------------- requests
class _Request(BaseModel):
    # JSON types exactly (true is not 1, "5" is not 5, 5.0 is not an integer) and no unknown fields.
    # A top-level field the model lacks never gets here: openai_fields.py refuses it or, when it is a
    # known option sent with its "off" value, drops it.
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: Literal[False] = False  # vLLM's; not implemented, so only "off" is taken


# OpenAI's documented limits for `metadata` (labels only: nothing here reads or stores them).
MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512


class _SamplingFields(_Request):
    """Fields both endpoints share; null means "not sent" for every one of them."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # OpenAI's end-user label; changes nothing, kept nowhere
    metadata: dict[str, str] | None = None  # labels; changes nothing, kept nowhere
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    priority: int | None = None  # lower runs first (vLLM's convention)
    cache_salt: str | None = None  # vLLM's: prefix-cache entries are shared only within one salt

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def _check_common(self) -> None:
        if self.n is not None and self.n != 1:
            raise APIError.bad_request("n: only n=1 is supported", "n", "unsupported_value")
        if self.stream_options is not None and not self.stream:
            raise APIError.bad_request("stream_options: only allowed when stream is true", "stream_options")
        meta = self.metadata or {}
        if len(meta) > MAX_METADATA_PAIRS or any(len(k) > MAX_METADATA_KEY_CHARS or len(v) > MAX_METADATA_VALUE_CHARS
                                                 for k, v in meta.items()):
            raise APIError.bad_request(f"metadata: at most {MAX_METADATA_PAIRS} pairs, keys of at most "
                                       f"{MAX_METADATA_KEY_CHARS} and values of at most {MAX_METADATA_VALUE_CHARS} "
                                       "characters", "metadata", "invalid_value")

    def _sampling_input(self, max_tokens: int | None, max_tokens_field: str) -> SamplingInput:
        self._check_common()
        return SamplingInput(max_tokens=max_tokens, max_tokens_field=max_tokens_field, temperature=self.temperature,
                             top_p=self.top_p, top_k=self.top_k, seed=self.seed, stop=self.stop,
                             stop_token_ids=list(self.stop_token_ids or []), ignore_eos=bool(self.ignore_eos),
                             min_tokens=self.min_tokens)


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. One prompt: a string or a list of token ids."""

    prompt: str | list[int] | list[str] | list[list[int]]

    def single_prompt(self) -> str | list[int]:
        """The one prompt; a one-element batch is unwrapped. Raises APIError for batches and empties."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError.bad_request(
                    f"prompt: batches of {len(p)} prompts are not supported; send one prompt per request",
                    "prompt", "unsupported_value")
            p = p[0]
        if not p:
            raise APIError.bad_request("prompt: must not be empty", "prompt", "invalid_value")
        return p

    def prompt_input(self) -> PromptInput:
        prompt = self.single_prompt()
        return PromptInput(PromptKind.TEXT if isinstance(prompt, str) else PromptKind.TOKEN_IDS, prompt, "prompt")

    def sampling_input(self) -> SamplingInput:
        return self._sampling_input(self.max_tokens, "max_tokens")


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: str
    content: str | list[TextContentPart | dict[str, Any]] | None = None
    # What OpenAI's SDKs send back with an assistant turn; taken only when empty (no tools here).
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    function_call: Any = None
    refusal: str | None = None
    audio: Any = None

    def template_content(self, index: int) -> str:
        for name in ("name", "tool_calls", "tool_call_id", "function_call", "refusal", "audio"):
            if getattr(self, name) not in (None, []):
                raise APIError.bad_request(f"messages[{index}].{name}: not supported", "messages",
                                           "unsupported_parameter")
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        texts = []
        for part in self.content:
            if not isinstance(part, TextContentPart):
                kind = part.get("type", "?")
                why = ("a text part has exactly `type` and `text`" if kind == "text" else
                       f"content parts of type {str(kind)[:32]!r} are not supported; send text")
                raise APIError.bad_request(f"messages[{index}].content: {why}", "messages", "unsupported_value")
            texts.append(part.text)
        return "".join(texts)


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None

    def template_messages(self) -> list[dict[str, str]]:
        if not self.messages:
            raise APIError.bad_request("messages: must not be empty", "messages", "invalid_value")
        return [{"role": m.role, "content": m.template_content(i)} for i, m in enumerate(self.messages)]

    def prompt_input(self) -> PromptInput:
        return PromptInput(PromptKind.CHAT, self.template_messages(), "messages")

    def sampling_input(self) -> SamplingInput:
        # max_completion_tokens is OpenAI's newer name for max_tokens; two different values are refused.
        new, old = self.max_completion_tokens, self.max_tokens
        if new is not None and old is not None and new != old:
            raise APIError.bad_request("max_tokens: differs from max_completion_tokens; send one of them",
                                       "max_tokens", "invalid_value")
        if new is not None:
            return self._sampling_input(new, "max_completion_tokens")
        return self._sampling_input(old, "max_tokens")


# ---------------------------------------------------------------------- responses
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache, not recomputed


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int = 0) -> UsageInfo:
        return cls(prompt_tokens=num_prompt_tokens, completion_tokens=num_completion_tokens,
                   total_tokens=num_prompt_tokens + num_completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached_tokens))


def _now() -> int:
    return int(time.time())


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class CompletionStreamResponse(CompletionResponse):
    """One SSE chunk of /v1/completions (same shape as the full response, with partial text)."""


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatCompletionChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):  # OpenAI sends {"content": "x"}, not {"role": null, "content": "x"}
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionStreamChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "pdserve"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
