"""The OpenAI HTTP schema (pydantic v2): requests and error objects (the answers: openai_responses.py).

Pydantic lives only at the HTTP edge. A request's `prompt_input()` and `sampling_input()`
check what only the OpenAI schema has (n, batches, content parts, ...) and hand the rest to
the protocol-neutral preparation (deployments/frontend/prepare.py, which also holds the max_tokens
defaults). Which top-level fields are taken at all: openai_fields.py. Every user error becomes an
`APIError` that the HTTP app answers with `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from deployments.frontend.fanout import MAX_CHOICES, MAX_N, MAX_PROMPTS
from deployments.frontend.prepare import PromptInput, PromptKind, SamplingInput
from deployments.frontend.structured_request import FieldSpec, one_constraint, specs_from_fields
from deployments.frontend.tool_calls import ToolPlan, history_tool_fields, plan_tools
from engine import InvalidRequestError, PromptTooLongError
from engine.sampling_params import MAX_LOGPROBS
from engine.structured import StructuredSpec

_TOKEN_ID_KEY = re.compile(r"[0-9]{1,10}")  # a logit_bias key


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
    speculative: bool | None = None  # pdserve's: false opts this request out of speculative decoding
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's
    min_p: float | None = None  # vLLM's
    logit_bias: dict[str, float] | None = None  # token id (written as a decimal string) -> bias
    # Structured outputs (structured_request.py): OpenAI's response_format, vLLM's guided_* and structured_outputs.
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def num_samples(self) -> int:
        return 1 if self.n is None else self.n

    def _check_common(self) -> None:
        if not 1 <= self.num_samples <= MAX_N:
            raise APIError.bad_request(f"n: must be an integer in [1, {MAX_N}]", "n", "invalid_value")
        if self.stream_options is not None and not self.stream:
            raise APIError.bad_request("stream_options: only allowed when stream is true", "stream_options")
        meta = self.metadata or {}
        if len(meta) > MAX_METADATA_PAIRS or any(len(k) > MAX_METADATA_KEY_CHARS or len(v) > MAX_METADATA_VALUE_CHARS
                                                 for k, v in meta.items()):
            raise APIError.bad_request(f"metadata: at most {MAX_METADATA_PAIRS} pairs, keys of at most "
                                       f"{MAX_METADATA_KEY_CHARS} and values of at most {MAX_METADATA_VALUE_CHARS} "
                                       "characters", "metadata", "invalid_value")

    def _constraints(self) -> list[FieldSpec]:
        """The output constraints sent, each checked (more than one is refused by `one_constraint`)."""
        return specs_from_fields({name: getattr(self, name) for name in (
            "response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")})

    def _logit_bias(self) -> dict[int, float] | None:
        """Keys are token ids as decimal strings (JSON object keys); their range is checked by prepare.py."""
        if not self.logit_bias:
            return None  # {} is "off"
        if any(not _TOKEN_ID_KEY.fullmatch(key) for key in self.logit_bias):
            raise APIError.bad_request("logit_bias: keys must be token ids written as decimal integers",
                                       "logit_bias", "invalid_value")
        return {int(key): value for key, value in self.logit_bias.items()}

    def _sampling_input(self, max_tokens: int | None, max_tokens_field: str, logprobs: int | None = None,
                        prompt_logprobs: int | None = None) -> SamplingInput:
        self._check_common()
        return SamplingInput(max_tokens=max_tokens, max_tokens_field=max_tokens_field, temperature=self.temperature,
                             top_p=self.top_p, top_k=self.top_k, seed=self.seed, stop=self.stop,
                             stop_token_ids=list(self.stop_token_ids or []), ignore_eos=bool(self.ignore_eos),
                             min_tokens=self.min_tokens, speculative=self.speculative is not False,
                             presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                             repetition_penalty=self.repetition_penalty, min_p=self.min_p,
                             logit_bias=self._logit_bias(), logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                             structured=self._structured())

    def _structured(self) -> StructuredSpec | None:
        found = one_constraint(self._constraints())
        return None if found is None else found.spec


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. A prompt (a string or a list of token ids) or a batch of them: one choice
    per prompt and sample, index = prompt index * n + sample index."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None  # per token: its logprob and the top `logprobs` alternatives
    echo: bool | None = None  # the prompt before the completion (with logprobs: the prompt's too)

    @property
    def score_only(self) -> bool:
        """`echo` with `max_tokens: 0`: the prompt (and its logprobs) only, nothing generated."""
        return bool(self.echo) and self.max_tokens == 0

    def prompt_inputs(self) -> list[PromptInput]:
        """The prompts, one per choice group. Raises APIError for empties and oversized batches."""
        p = self.prompt
        prompts = p if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]
        if len(prompts) > MAX_PROMPTS:
            raise APIError.bad_request(f"prompt: at most {MAX_PROMPTS} prompts in a batch, got {len(prompts)}",
                                       "prompt", "invalid_value")
        if len(prompts) * self.num_samples > MAX_CHOICES:
            raise APIError.bad_request(f"n: prompts x n must be at most {MAX_CHOICES}", "n", "invalid_value")
        if any(not q for q in prompts):
            raise APIError.bad_request("prompt: must not be empty", "prompt", "invalid_value")
        return [PromptInput(PromptKind.TEXT if isinstance(q, str) else PromptKind.TOKEN_IDS, q, "prompt")
                for q in prompts]

    def sampling_input(self) -> SamplingInput:
        max_tokens = self.max_tokens
        if self.score_only:
            if self.min_tokens:
                raise APIError.bad_request("min_tokens: must be 0 with max_tokens 0", "min_tokens", "invalid_value")
            max_tokens = 1  # NOTE: the engine generates at least one token; fanout.py drops it
        return self._sampling_input(max_tokens, "max_tokens", self.logprobs, self.logprobs if self.echo else None)


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: str
    content: str | list[TextContentPart | dict[str, Any]] | None = None
    # What OpenAI's SDKs send back with an assistant turn; taken only when empty, but tool_calls and
    # tool_call_id, which tool_calls.py hands to templates that render them.
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    function_call: Any = None
    refusal: str | None = None
    audio: Any = None

    def template_content(self, index: int) -> str:
        for name in ("name", "function_call", "refusal", "audio"):  # tool_calls, tool_call_id: tool_calls.py
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
    logprobs: bool | None = None  # per generated token: its logprob (and top_logprobs alternatives)
    top_logprobs: int | None = None  # 0..20, only with logprobs: true
    # Tool calls through structured outputs (tool_calls.py).
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def tool_plan(self) -> ToolPlan:
        """What `tools` and `tool_choice` mean for this request; raises InvalidRequestError."""
        return plan_tools(self.tools, self.tool_choice, self.parallel_tool_calls)

    def _structured(self) -> StructuredSpec | None:
        spec = self.tool_plan().spec
        found = self._constraints() + ([FieldSpec(spec, "tool_choice")] if spec is not None else [])
        one = one_constraint(found)
        return None if one is None else one.spec

    def _logprobs(self) -> int | None:
        """What the engine's `logprobs` gets: None (off) or the number of alternatives."""
        k = self.top_logprobs
        if k is not None and not 0 <= k <= MAX_LOGPROBS:
            raise APIError.bad_request(f"top_logprobs: must be an integer in [0, {MAX_LOGPROBS}]", "top_logprobs",
                                       "invalid_value")
        if not self.logprobs:
            if k:
                raise APIError.bad_request("top_logprobs: requires logprobs: true", "top_logprobs", "invalid_value")
            return None
        return k or 0

    def template_messages(self) -> list[dict[str, str]]:
        if not self.messages:
            raise APIError.bad_request("messages: must not be empty", "messages", "invalid_value")
        return [{"role": m.role, "content": m.template_content(i),
                 **history_tool_fields(i, m.role, m.tool_calls, m.tool_call_id)} for i, m in enumerate(self.messages)]

    def prompt_input(self) -> PromptInput:
        return PromptInput(PromptKind.CHAT, self.template_messages(), "messages", self.tool_plan().template_tools)

    def sampling_input(self) -> SamplingInput:
        # max_completion_tokens is OpenAI's newer name for max_tokens; two different values are refused.
        new, old = self.max_completion_tokens, self.max_tokens
        if new is not None and old is not None and new != old:
            raise APIError.bad_request("max_tokens: differs from max_completion_tokens; send one of them",
                                       "max_tokens", "invalid_value")
        if new is not None:
            return self._sampling_input(new, "max_completion_tokens", self._logprobs())
        return self._sampling_input(old, "max_tokens", self._logprobs())
