"""One request's generation as text, for both doors: backend TokenDeltas → TextChunks.

    backend.generate(...) ──TokenDelta──▶ IncrementalDetokenizer ──▶ StopStringFilter ──▶ TextChunk
                                                                    (stop hit: abort the backend request)

`TextStream` owns the backend request: `start()` waits for the first event (refusals raise there,
before anything was sent), `chunks()` yields text, and `close()` aborts the request unless it
finished, so a client that goes away (a cancelled task, a closed generator) never leaves it running.
The doors only format chunks (SSE / JSON / protobuf) and map errors.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, AsyncIterator, NamedTuple

import anyio

from deployments.frontend.backend import GenerateBackend, QueueFullError, TokenDelta
from engine import InvalidRequestError, SamplingParams
from engine.errors import parse_invalid_request

if TYPE_CHECKING:
    from engine.request import TokenLogprob

logger = logging.getLogger(__name__)


class IncrementalDetokenizer:
    """Token ids in, text deltas out; the deltas concatenate to `tokenizer.decode(all ids)`.

    Decodes a short window `ids[prefix_offset:]` against `ids[prefix_offset:read_offset]` (vLLM's
    prefix-offset scheme) so merged/multi-byte tokens come out whole: while the window ends in U+FFFD
    (an incomplete UTF-8 sequence) nothing is emitted.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        # NOTE: a fast tokenizer without the space clean-up decodes exactly as its Rust tokenizer does;
        # calling that directly skips transformers' wrapper (two decodes per token per stream).
        backend = getattr(tokenizer, "_tokenizer", None)
        self._backend = backend if hasattr(backend, "decode") and \
            getattr(tokenizer, "clean_up_tokenization_spaces", True) is False else None
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self._skip)
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def push(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        self.token_ids.extend(token_ids)
        prefix = self._decode(self.token_ids[self._prefix_offset:self._read_offset])
        window = self._decode(self.token_ids[self._prefix_offset:])
        if len(window) <= len(prefix) or window.endswith("\ufffd"):
            return ""  # NOTE: hold an incomplete character until the token that completes it
        delta = window[len(prefix):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of the sequence: whatever is still held, as the full decode has it."""
        full = self._decode(self.token_ids)
        if len(full) <= len(self.text) or not full.startswith(self.text):
            return ""
        delta, self.text = full[len(self.text):], full
        return delta


class StopStringFilter:
    """Cuts streamed text at the first stop string.

    NOTE: only new text is searched, with the held-back tail in front of it (never the whole output),
    and text that could be the start of a stop string is held back until it is known not to be, so
    no part of a stop string is ever sent.
    """

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self._max_hold = max((len(s) for s in self.stops), default=1) - 1
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to send, whether a stop string was hit). After a hit, send nothing more."""
        if not self.stops:
            return text, False
        buf = self._held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i != -1]
        if hits:
            self._held = ""
            return buf[:min(hits)], True
        hold = 0
        for k in range(min(len(buf), self._max_hold), 0, -1):
            if any(s.startswith(buf[-k:]) for s in self.stops):
                hold = k
                break
        self._held = buf[len(buf) - hold:]
        return buf[:len(buf) - hold], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held


class GenerationFailed(Exception):
    """The backend failed the request (or ended it without output). `reason` is the backend's and may
    hold internal text: doors log it and answer a generic message (never the reason) to the client."""

    def __init__(self, reason: str, request_id: str = ""):
        super().__init__(f"generation failed: {reason}")
        self.reason = reason
        self.request_id = request_id


class TextChunk(NamedTuple):
    text: str  # text since the previous chunk, cut before any stop string; may be ""
    token_ids: list[int]  # tokens generated since the previous chunk (a stop string's may be among them)
    finish_reason: str | None  # set on the last chunk only: "stop" | "length" | "abort"
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids, when the request asked


class Usage(NamedTuple):
    num_prompt_tokens: int
    num_completion_tokens: int
    num_cached_tokens: int  # prompt tokens the (first) prefill found in the prefix cache


class TextStream:
    """One request's generation as text chunks plus usage counts; see the module docstring."""

    def __init__(self, backend: GenerateBackend, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams, priority: int, tokenizer: Any, cache_salt: str | None = None,
                 tenant: str | None = None, tenant_weight: float = 1.0):
        self.backend = backend
        self.request_id = request_id
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_completion_tokens = 0
        self.num_cached_tokens = 0  # from the first event
        self.finish_reason: str | None = None
        # One per prompt token ([0] is None) when the request asked (params.prompt_logprobs); set by start().
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self._detok = IncrementalDetokenizer(tokenizer)
        self._stops = StopStringFilter(params.stop)
        # NOTE: `cache_salt` only when set, so a backend without salts still serves unsalted requests.
        salt = {} if cache_salt is None else {"cache_salt": cache_salt}
        if tenant is not None:  # likewise: only a server with tenants passes them
            salt.update(tenant=tenant, tenant_weight=tenant_weight)
        self._gen = backend.generate(request_id, prompt_token_ids, params, priority, **salt)
        self._first: TokenDelta | None = None
        # Nothing to abort until `start` enters the backend's generate (it may submit at once), and
        # nothing after the backend ended or refused the request.
        self._done = True

    async def start(self) -> None:
        """Wait for the first event. Raises what the backend raises before accepting the request
        (`QueueFullError`, `InvalidRequestError`) and `GenerationFailed` if it fails at once."""
        self._done = False  # from here on a cancellation (client gone during submit) must abort
        try:
            self._first = await self._gen.__anext__()
        except StopAsyncIteration:
            self._done = True
            raise self._failed("the backend ended the request without output") from None
        except (QueueFullError, InvalidRequestError):
            # NOTE: refused: never accepted, nothing to abort. Any other failure or a cancellation
            # (client gone during submit, queue wait over) leaves the request to close()'s abort.
            self._done = True
            raise
        first = self._first
        self.num_cached_tokens = first.num_cached_tokens
        self.prompt_logprobs = first.prompt_logprobs
        if first.finished and first.finish_reason == "error" and not first.token_ids:
            self._done = True
            refused = parse_invalid_request(first.error)  # e.g. its grammar did not compile in the engine
            if refused is not None:
                raise refused
            raise self._failed(first.error or "the backend reported an error")

    async def chunks(self) -> AsyncIterator[TextChunk]:
        """Chunks with text or tokens; the last one has finish_reason. A failure after the first chunk
        raises `GenerationFailed` (after a chunk with whatever came before it)."""
        assert self._first is not None, "call start() first"
        delta, self._first = self._first, None
        while True:
            self.num_completion_tokens += len(delta.token_ids)
            text = self._detok.push(delta.token_ids)
            if delta.finished:
                self._done = True
                text += self._detok.flush()
            out, stopped = self._stops.feed(text)
            lps = delta.logprobs
            if stopped:
                await self._abort()  # NOTE: the model may still be generating: its tokens are unwanted
                self.finish_reason = "stop"
                yield TextChunk(out, delta.token_ids, "stop", lps)
                return
            if delta.finished:
                out += self._stops.flush()
                if delta.finish_reason == "error":
                    if out or delta.token_ids:
                        yield TextChunk(out, delta.token_ids, None, lps)
                    raise self._failed(delta.error or "the backend reported an error")
                self.finish_reason = delta.finish_reason or "stop"
                yield TextChunk(out, delta.token_ids, self.finish_reason, lps)
                return
            if out or delta.token_ids:
                yield TextChunk(out, delta.token_ids, None, lps)
            try:
                delta = await self._gen.__anext__()
            except StopAsyncIteration:
                self._done = True
                raise self._failed("the backend stream ended before the request finished") from None

    async def close(self) -> None:
        """Abort the backend request unless it finished; safe to call from a cancelled task."""
        with anyio.CancelScope(shield=True):
            try:
                await self._abort()
            finally:
                await self._gen.aclose()

    def _failed(self, reason: str) -> GenerationFailed:
        logger.warning("request %s failed: %s", self.request_id, reason)
        return GenerationFailed(reason, self.request_id)

    async def _abort(self) -> None:
        if not self._done:
            self._done = True
            try:
                await self.backend.abort(self.request_id)
            except Exception:  # noqa: BLE001 - e.g. the router is gone: nothing left to stop, keep closing
                logger.warning("aborting request %s failed", self.request_id, exc_info=True)

    @property
    def usage(self) -> Usage:
        return Usage(self.num_prompt_tokens, self.num_completion_tokens, self.num_cached_tokens)
