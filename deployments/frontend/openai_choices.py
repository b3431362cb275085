"""OpenAI `choices[]` objects from a FanOut's chunks: streamed one chunk at a time, or whole.

    ChoiceChunk(index, text, token_ids, finish_reason, logprobs) ──▶ CompletionChoice / ChatCompletionStreamChoice
                                          (merged per index)     ──▶ CompletionChoice / ChatCompletionChoice

Per choice it adds what the first chunk carries: completions' `echo` (the prompt's text and, with
`logprobs`, the prompt tokens' logprobs: the first token's null) and logprobs in OpenAI's shapes
(logprobs_format.py). A chunk with nothing to show (no text, no finish, no logprobs) gives None.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from deployments.frontend.fanout import ChoiceChunk, FanOut
from deployments.frontend.logprobs_format import (
    ChatLogprobs, CompletionLogprobs, CompletionLogprobsBuilder, TokenText, chat_logprobs, merge_completion_logprobs)
from deployments.frontend.openai_responses import (
    AssistantMessage, ChatCompletionChoice, ChatCompletionStreamChoice, CompletionChoice, DeltaMessage, DeltaToolCall,
    ToolCallObject)
from deployments.frontend.tool_calls import ToolCallReader, ToolOutput


@dataclass(frozen=True, slots=True)
class ChoiceOptions:
    """How the choices of one request look.

    logprobs: format per-token logprobs (the request asked: completions `logprobs`, chat `logprobs: true`).
    echo_texts: completions with `echo`: per prompt, the text put before its choices' completions.
    """

    chat: bool
    logprobs: bool = False
    echo_texts: Sequence[str] | None = None
    tools: ToolOutput | None = None  # chat, tool_choice required / named: the text is tool calls (tool_calls.py)


class ChoiceFormatter:
    """Builds one request's choice objects; holds per-choice state (echo sent, text offsets)."""

    def __init__(self, fan: FanOut, tokenizer: Any, opts: ChoiceOptions):
        self.fan = fan
        self.opts = opts
        self.texts = TokenText(tokenizer)
        self._builders: dict[int, CompletionLogprobsBuilder] = {}
        self._tools = ToolCallReader(opts.tools) if opts.tools is not None else None

    # ------------------------------------------------------------------ completions
    def _echo(self, index: int, builder: CompletionLogprobsBuilder) -> tuple[str, CompletionLogprobs | None]:
        """The echoed prompt of choice `index` (its first chunk) and, with logprobs, the prompt's entries."""
        p = self.fan.prompt_index(index)
        text = self.opts.echo_texts[p]
        if not self.opts.logprobs:
            return text, None
        prompt_ids = self.fan.prepared[p].prompt_token_ids
        lps = self.fan.prompt_logprobs(index) or [None] * len(prompt_ids)
        entries = builder.add(prompt_ids, lps)
        builder.offset = len(text)  # generated tokens' offsets start after the echoed text
        return text, entries

    def completion(self, c: ChoiceChunk) -> CompletionChoice | None:
        """The choice object of one chunk (streamed), or None when it has nothing to show."""
        text, parts = c.text, []
        builder = self._builders.get(c.index)
        if builder is None:
            builder = self._builders[c.index] = CompletionLogprobsBuilder(self.texts)
            if self.opts.echo_texts is not None:
                echoed, entries = self._echo(c.index, builder)
                text = echoed + text
                if entries is not None:
                    parts.append(entries)
        if self.opts.logprobs and c.token_ids:
            parts.append(builder.add(c.token_ids, c.logprobs or [None] * len(c.token_ids)))
        logprobs = merge_completion_logprobs(parts) if self.opts.logprobs else None
        if not (text or c.finish_reason or (logprobs is not None and logprobs.tokens)):
            return None
        return CompletionChoice(index=c.index, text=text, logprobs=logprobs, finish_reason=c.finish_reason)

    def completion_choices(self, chunks: Sequence[ChoiceChunk]) -> list[CompletionChoice]:
        """Whole choices (non-streaming), in index order."""
        merged: dict[int, CompletionChoice] = {}
        for c in chunks:
            part = self.completion(c)
            if part is None:
                continue
            have = merged.get(c.index)
            if have is None:
                merged[c.index] = part
                continue
            have.text += part.text
            have.finish_reason = part.finish_reason or have.finish_reason
            if have.logprobs is not None and part.logprobs is not None:
                have.logprobs = merge_completion_logprobs([have.logprobs, part.logprobs])
        return [merged.get(k) or CompletionChoice(index=k, text="", finish_reason=self.fan.finish_reasons[k])
                for k in range(len(self.fan.streams))]

    # ------------------------------------------------------------------ chat
    def _chat_logprobs(self, c: ChoiceChunk) -> ChatLogprobs | None:
        if not self.opts.logprobs:
            return None
        return chat_logprobs(self.texts, c.token_ids, c.logprobs or [])

    def chat_roles(self) -> list[ChatCompletionStreamChoice]:
        """The first streamed chunk of every choice: the assistant role, no content yet."""
        return [ChatCompletionStreamChoice(index=k, delta=DeltaMessage(role="assistant", content=""))
                for k in range(len(self.fan.streams))]

    def chat_delta(self, c: ChoiceChunk) -> ChatCompletionStreamChoice | None:
        logprobs = self._chat_logprobs(c)
        if self._tools is not None:
            calls, finish = self._tools.feed(c.index, c.text, c.finish_reason)
            if not (calls or finish or (logprobs is not None and logprobs.content)):
                return None
            delta = DeltaMessage(tool_calls=[DeltaToolCall.of(d) for d in calls] or None)
            return ChatCompletionStreamChoice(index=c.index, delta=delta, logprobs=logprobs, finish_reason=finish)
        if not (c.text or c.finish_reason or (logprobs is not None and logprobs.content)):
            return None
        return ChatCompletionStreamChoice(index=c.index, delta=DeltaMessage(content=c.text or None),
                                          logprobs=logprobs, finish_reason=c.finish_reason)

    def chat_choices(self, chunks: Sequence[ChoiceChunk]) -> list[ChatCompletionChoice]:
        """Whole choices (non-streaming), in index order."""
        n = len(self.fan.streams)
        texts: list[list[str]] = [[] for _ in range(n)]
        contents: list[list] = [[] for _ in range(n)]
        for c in chunks:
            texts[c.index].append(c.text)
            logprobs = self._chat_logprobs(c)
            if logprobs is not None:
                contents[c.index] += logprobs.content or []
        return [ChatCompletionChoice(index=k, **self._message("".join(texts[k]), k),
                                     logprobs=ChatLogprobs(content=contents[k]) if self.opts.logprobs else None)
                for k in range(n)]

    def _message(self, text: str, k: int) -> dict[str, Any]:
        """Choice `k`'s message and finish_reason: its text, or the tool calls read from it."""
        if self._tools is None:
            return dict(message=AssistantMessage(content=text), finish_reason=self.fan.finish_reasons[k])
        _, finish = self._tools.feed(k, text, self.fan.finish_reasons[k])
        calls = [ToolCallObject.of(call) for call in self._tools.parser(k).calls]
        return dict(message=AssistantMessage(content=None, tool_calls=calls), finish_reason=finish)
