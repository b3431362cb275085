"""`n` samples and batched prompts: one client request as several backend requests ("choices").

    prepared prompts [p0, p1, ...] × n ──▶ choice k = prompt_index * n + i
        backend request id f"{request_id}-{k}" (a lone choice keeps `request_id`),
        seed: seed + i (mod 2**64, kept in the engine's range), or none (independent samples)
    ──▶ one TextStream per choice ──▶ merged as they arrive: ChoiceChunk(index=k, ...)

Both doors use it. The n siblings of one prompt are submitted together: the engine computes their
shared full prompt blocks once (shared prefill). Usage counts each prompt once and every choice's
completion tokens. One choice failing fails the whole request: the others are aborted.

`score_only` (a completions request with `echo` and `max_tokens: 0`): the engine needs
max_tokens >= 1, so each choice runs with max_tokens=1 (the request is built that way) and the
generated token is dropped here: the choice ends with finish_reason "length" and no tokens, and
counts no completion tokens; only its prompt (logprobs) is returned.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, NamedTuple, Sequence

from deployments.frontend.backend import GenerateBackend
from deployments.frontend.prepare import PreparedRequest
from deployments.frontend.text_stream import TextStream, Usage
from engine.sampling_params import SEED_MAX, SEED_MIN

if TYPE_CHECKING:
    from engine.request import TokenLogprob

MAX_N = 16  # samples per prompt
MAX_PROMPTS = 64  # prompts in one /v1/completions batch
MAX_CHOICES = 128  # prompts × n


def sibling_seed(seed: int | None, i: int) -> int | None:
    """The seed of sample `i` of a request seeded with `seed`: seed + i, wrapped modulo 2**64 into the
    engine's range [-2**63, 2**64 - 1] (so sample 0 keeps the request's own seed)."""
    if seed is None:
        return None
    s = seed + i
    if s > SEED_MAX:
        s -= 1 << 64
    assert SEED_MIN <= s <= SEED_MAX
    return s


class ChoiceChunk(NamedTuple):
    """A TextChunk of choice `index`."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None


class FanOut:
    """The choices of one request: start them together, stream their chunks merged, close them all.

    prepared: one PreparedRequest per prompt (same sampling values); n: samples per prompt.
    """

    def __init__(self, backend: GenerateBackend, request_id: str, prepared: Sequence[PreparedRequest], n: int,
                 tokenizer: Any, score_only: bool = False, on_close: Callable[[], None] | None = None):
        assert prepared and n >= 1
        self._on_close = on_close  # called once, by the first close(): the tenant's share given back
        self.request_id = request_id
        self.n = n
        self.score_only = score_only
        self.prepared = list(prepared)
        single = len(prepared) == 1 and n == 1
        self.streams: list[TextStream] = []
        for p, req in enumerate(prepared):
            for i in range(n):
                k = p * n + i
                # A copy per sibling: no two engine requests share one mutable params object.
                seed = sibling_seed(req.params.seed, i)
                params = req.params if n == 1 else dataclasses.replace(req.params, seed=seed)
                self.streams.append(TextStream(backend, request_id if single else f"{request_id}-{k}",
                                               req.prompt_token_ids, params, req.priority, tokenizer, req.cache_salt,
                                               req.tenant, req.tenant_weight))
        self.finish_reasons: list[str | None] = [None] * len(self.streams)

    def prompt_index(self, index: int) -> int:
        return index // self.n

    def prompt_logprobs(self, index: int) -> list[TokenLogprob | None] | None:
        return self.streams[index].prompt_logprobs

    async def start(self) -> None:
        """Submit every choice and wait for each one's first event. Raises the first choice's error
        (index order) after closing them all: refusals (QueueFullError, InvalidRequestError) and
        failures as `TextStream.start` raises them."""
        try:
            results = await asyncio.gather(*(s.start() for s in self.streams), return_exceptions=True)
        except BaseException:  # cancelled: the client left while its choices were being submitted
            await self.close()
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self.close()
            raise errors[0]

    async def chunks(self) -> AsyncIterator[ChoiceChunk]:
        """Every choice's chunks, as they arrive; each choice's last one has its finish_reason. A
        failure of any choice raises (the others are closed by `close`)."""
        if len(self.streams) == 1:
            async for c in self._choice(0):
                yield c
            return
        queue: asyncio.Queue = asyncio.Queue()
        pumps = [asyncio.ensure_future(self._pump(k, queue)) for k in range(len(self.streams))]
        try:
            left = len(pumps)
            while left:
                item = await queue.get()
                if item is None:
                    left -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for t in pumps:
                t.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)

    async def _pump(self, k: int, queue: asyncio.Queue) -> None:
        try:
            async for c in self._choice(k):
                queue.put_nowait(c)
            queue.put_nowait(None)
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait(e)

    async def _choice(self, k: int) -> AsyncIterator[ChoiceChunk]:
        stream = self.streams[k]
        if self.score_only:
            await stream.close()  # the one generated token is not wanted (see the module docstring)
            self.finish_reasons[k] = "length"
            yield ChoiceChunk(k, "", [], "length")
            return
        async for c in stream.chunks():
            if c.finish_reason:
                self.finish_reasons[k] = c.finish_reason
            yield ChoiceChunk(k, c.text, c.token_ids, c.finish_reason, c.logprobs)

    async def close(self) -> None:
        """Abort every choice that did not finish; safe to call from a cancelled task."""
        try:
            for s in self.streams:
                await s.close()
        finally:
            done, self._on_close = self._on_close, None
            if done is not None:
                done()

    @property
    def usage(self) -> Usage:
        """Prompt tokens (and prefix-cache hits) once per prompt, completion tokens of every choice."""
        heads = self.streams[::self.n]
        completion = 0 if self.score_only else sum(s.num_completion_tokens for s in self.streams)
        return Usage(sum(s.num_prompt_tokens for s in heads), completion, sum(s.num_cached_tokens for s in heads))
