"""OpenAI logprobs objects from the engine's per-token logprobs (pure formatting: no I/O, no backend).

    engine TokenLogprob(token_id, logprob, top=[(id, logprob), ...])  ──▶  completions:
        {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob}], "text_offset": [...]}
                                                                   ──▶  chat:
        {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}

Values are the engine's: log_softmax of the model's fp32 logits before temperature, penalties, biases
or masks ("raw" logprobs, vLLM's default). A token's text is `tokenizer.decode([id])`; a token that is
not whole UTF-8 on its own (part of a multi-byte character) is shown as OpenAI does, "bytes:\\xe2\\x80",
and its `bytes` are the raw bytes the tokenizer maps it to. Completions' `text_offset` is, as in vLLM,
the running sum of the token strings' lengths (from 0, or from the end of the echoed prompt).
"""

from __future__ import annotations

import functools
import re
from typing import TYPE_CHECKING, Any, Sequence

from pydantic import BaseModel

if TYPE_CHECKING:
    from engine.request import TokenLogprob

# JSON has no -inf: a token the model gives probability 0 is reported with this (vLLM's convention).
MIN_LOGPROB = -9999.0
_HEX_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # sentencepiece's byte-fallback tokens


@functools.lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """Byte-level BPE (GPT-2 style) writes each byte as one printable character: the printable
    Latin-1 bytes stand for themselves, every other byte for chr(256 + k), k counting them in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def clamp(logprob: float) -> float:
    return logprob if logprob >= MIN_LOGPROB else MIN_LOGPROB  # also maps -inf (and NaN) to the floor


class TokenText:
    """Per-token text and bytes for one tokenizer, cached by token id."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, bytes]] = {}

    def _compute(self, token_id: int) -> tuple[str, bytes]:
        text = self._tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text, text.encode("utf-8")
        piece = self._tokenizer.convert_ids_to_tokens(token_id) or ""
        match = _HEX_BYTE.fullmatch(piece)
        decoder = _byte_level_decoder()
        if match:
            raw = bytes([int(match.group(1), 16)])
        elif piece and all(c in decoder for c in piece):
            raw = bytes(decoder[c] for c in piece)
        else:
            raw = text.encode("utf-8")
        try:
            return raw.decode("utf-8"), raw
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw

    def get(self, token_id: int) -> tuple[str, bytes]:
        """(text shown for the token, its UTF-8 bytes)."""
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._compute(token_id)
        return hit

    def text(self, token_id: int) -> str:
        return self.get(token_id)[0]


# ---------------------------------------------------------------------- completions (/v1/completions)
class CompletionLogprobs(BaseModel):
    """`choices[].logprobs` of a text completion (or of one stream chunk)."""

    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionLogprobsBuilder:
    """Builds completions logprobs chunk by chunk; `text_offset` continues across chunks."""

    def __init__(self, texts: TokenText, offset: int = 0):
        self._texts = texts
        self.offset = offset

    def add(self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob | None]) -> CompletionLogprobs:
        """Entries for `token_ids`; `logprobs[i]` None (the first prompt token) gives null entries."""
        out = CompletionLogprobs()
        for token_id, lp in zip(token_ids, logprobs):
            text = self._texts.text(token_id)
            out.tokens.append(text)
            out.text_offset.append(self.offset)
            self.offset += len(text)
            if lp is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(clamp(lp.logprob))
            # vLLM's shape: the top alternatives plus the chosen token (a dict: equal texts collapse).
            top = {self._texts.text(t): clamp(v) for t, v in lp.top}
            top.setdefault(text, clamp(lp.logprob))
            out.top_logprobs.append(top)
        return out

    def skip(self, text: str) -> None:
        """Text before the next token that has no entries (an echoed prompt scored without logprobs)."""
        self.offset += len(text)


def merge_completion_logprobs(parts: Sequence[CompletionLogprobs]) -> CompletionLogprobs:
    out = CompletionLogprobs()
    for p in parts:
        out.tokens += p.tokens
        out.token_logprobs += p.token_logprobs
        out.top_logprobs += p.top_logprobs
        out.text_offset += p.text_offset
    return out


# ---------------------------------------------------------------------- chat (/v1/chat/completions)
class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    """`choices[].logprobs` of a chat completion (or of one stream chunk)."""

    content: list[ChatTokenLogprob] | None = None


def chat_logprobs(texts: TokenText, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob]) -> ChatLogprobs:
    """One entry per generated token with its top alternatives (exactly `top_logprobs` of them, best first)."""
    content = []
    for token_id, lp in zip(token_ids, logprobs):
        text, raw = texts.get(token_id)
        top = [TopLogprob(token=texts.text(t), logprob=clamp(v), bytes=list(texts.get(t)[1])) for t, v in lp.top]
        content.append(ChatTokenLogprob(token=text, logprob=clamp(lp.logprob), bytes=list(raw), top_logprobs=top))
    return ChatLogprobs(content=content)
