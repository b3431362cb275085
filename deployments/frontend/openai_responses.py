"""The OpenAI HTTP schema's answers (pydantic v2): responses, stream chunks, usage, models.

The requests and error objects are in openai_protocol.py; openai_choices.py builds the `choices`.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, Field, model_serializer

from deployments.frontend.logprobs_format import ChatLogprobs, CompletionLogprobs
from deployments.frontend.tool_calls import ToolCall, ToolCallDelta


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
    logprobs: CompletionLogprobs | None = None
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


class FunctionCall(BaseModel):
    name: str
    arguments: str  # the arguments as JSON text


class ToolCallObject(BaseModel):
    """One entry of `message.tool_calls` (tool_calls.py reads it from the constrained text)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall

    @classmethod
    def of(cls, call: ToolCall) -> ToolCallObject:
        return cls(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None when the answer is tool_calls
    tool_calls: list[ToolCallObject] | None = None

    @model_serializer(mode="wrap")
    def _drop_no_tools(self, handler):  # as before tools: {"role", "content"} unless there are calls
        out = handler(self)
        if out.get("tool_calls") is None:
            out.pop("tool_calls", None)
        return out


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(BaseModel):
    """A streamed piece of a tool call: index, id, type and name first (arguments ""), then fragments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}

    @classmethod
    def of(cls, d: ToolCallDelta) -> DeltaToolCall:
        if d.id is None:
            return cls(index=d.index, function=DeltaFunctionCall(arguments=d.arguments))
        return cls(index=d.index, id=d.id, type="function", function=DeltaFunctionCall(name=d.name,
                                                                                        arguments=d.arguments))


class ChatCompletionChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
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
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):  # OpenAI sends {"content": "x"}, not {"role": null, "content": "x"}
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionStreamChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
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
