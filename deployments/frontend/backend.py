"""What the doors talk to: a `GenerateBackend` turns prompt token ids into a stream of `TokenDelta`s.

The HTTP app and the gRPC door both consume it through `text_stream.TextStream`. Two implementations
share the protocol:
- `LocalEngineBackend` (here): one `LLMEngine` on an `EngineHost` (deployments/engine_host.py) in
  this process (the single-process layout; what tests/deployments/test_ingress.py and test_grpc.py use).
- `RouterBackend` (router_client.py): prefill and decode pools behind the Ray router.

```
 event loop(s)                         engine thread (EngineHost: owns the LLMEngine)
 generate() ──register stream──▶ host.post ──▶ add_request / abort / call
   ▲                                               │ step()
   └── asyncio.Queue ◀── call_soon_threadsafe ◀────┘ RequestOutputs → TokenDelta
```
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Protocol, runtime_checkable

from deployments import metrics, tracing
from engine import InvalidRequestError, SamplingParams

if TYPE_CHECKING:
    from engine import LLMEngine
    from engine.request import TokenLogprob

logger = logging.getLogger(__name__)

FINISH_REASONS = ("stop", "length", "abort", "error")
# The `pool` and `worker_id` tags of this layout's metrics (deployments/metrics.py): one engine that
# both prefills and decodes.
METRICS_POOL = "single"
# An idle engine checks its KV cache's integrity this often (mini-sglang's habit: leaks show early).
IDLE_CHECK_S = 1.0


@dataclass(slots=True)
class TokenDelta:
    """One streamed event for one request.

    token_ids: tokens generated since the previous event (may be empty on the final event).
    finish_reason: set iff `finished`; one of FINISH_REASONS. "error" comes with `error`.
    num_prompt_tokens: the prompt length as the backend counted it (for usage).
    num_cached_tokens: prompt tokens whose KV the prefill took from the prefix cache (for usage's
        `prompt_tokens_details.cached_tokens`); the first event's value is the one that counts.
    logprobs: one `TokenLogprob` per token of `token_ids` when the request asked (`params.logprobs`).
    prompt_logprobs: one per prompt token ([0] is None), on the first event of a request that asked
        (`params.prompt_logprobs`).
    """

    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


class QueueFullError(RuntimeError):
    """The backend will not queue another request now; the client should retry after `retry_after_s`.

    Raised by `generate` before its first event, so the door can still answer 429 / RESOURCE_EXHAUSTED.
    """

    def __init__(self, message: str = "the server is at capacity; retry later", retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


@runtime_checkable
class GenerateBackend(Protocol):
    """Where tokens come from. The doors own tokenization (prepare.py), detokenization and stop strings
    (text_stream.py).

    `generate` is an async generator. Errors the caller caused (`InvalidRequestError`, including
    `PromptTooLongError`) and `QueueFullError` are raised before the first event; failures after it
    arrive as a final event with finish_reason "error" (its `error` may hold internal text: the doors
    log it, never show it). Closing the generator early (client gone) must not leak the request, but
    `TextStream` also calls `abort` explicitly: `abort` of a request that is unknown (never submitted,
    or cancelled while submitting) or already finished is a no-op that leaves nothing behind.
    `cache_salt`: the request shares prefix-cache entries only with requests of the same salt.
    `tenant` / `tenant_weight`: the API key's tenant and its share (frontend/tenants.py), for the
    engines' fair queueing; passed only by a server with tenants.
    """

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 priority: int = 0, cache_salt: str | None = None, tenant: str | None = None,
                 tenant_weight: float = 1.0) -> AsyncIterator[TokenDelta]: ...

    async def abort(self, request_id: str) -> None: ...

    async def health(self) -> dict: ...


def _list_or_none(items: list | None) -> list | None:
    return None if items is None else list(items)  # a copy: coalescing extends it


@dataclass(slots=True)
class _Stream:
    """Where one request's deltas go: a queue owned by the event loop that called `generate`."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    num_prompt_tokens: int = 0
    trace: Any = None  # the door's RequestTrace (deployments/tracing.py); None: not traced


class LocalEngineBackend:
    """Runs one `LLMEngine` on a background thread and streams its outputs to asyncio callers.

    NOTE: only the engine thread touches the engine; callers post it commands (add, abort, call) that
    it applies between steps (`EngineHost.post`), so a step never blocks an event loop. Use `run_on_engine` to inspect the
    engine safely from outside (tests: `check_integrity`).

    max_num_requests: at most this many requests in flight (queued or running); more raise
    `QueueFullError` with `retry_after_s`. None: unbounded.
    max_queued_requests: at most this many requests accepted but not yet running in the engine (the
    Ray layouts' `max_queued_requests`: requests admitted but not decoding); more raise `QueueFullError`.
    request_timeout_s: a request that gets no event for this long ends with finish_reason "error" (and
    is aborted), as the router's backend does. None: it waits as long as the engine takes.
    """

    def __init__(self, engine: LLMEngine, max_num_requests: int | None = None, retry_after_s: float = 1.0,
                 idle_integrity_check: bool = True, max_queued_requests: int | None = None,
                 request_timeout_s: float | None = None):
        self.engine = engine
        self.max_num_requests = max_num_requests
        self.max_queued_requests = max_queued_requests
        self.request_timeout_s = request_timeout_s
        self.retry_after_s = retry_after_s
        self.idle_integrity_check = idle_integrity_check
        self._cv = threading.Lock()
        self._streams: dict[str, _Stream] = {}  # guarded by _cv
        self._closed = False
        self._idle_since: float | None = None  # engine thread only
        # Structured requests' waits for their grammar, drained after each step into `grammar.compile` spans.
        self._grammar_waits = engine.watch_grammar_waits()
        from deployments.engine_host import EngineHost, HostHooks  # torch: the door's process does not need it

        self.host = EngineHost(engine, "pdserve", HostHooks(after_step=self._deliver_step, step_failed=self._step_failed,
                                                           idle=self._idle_check, closing=self._close_all),
                               idle_wait_s=IDLE_CHECK_S)
        self.host.start()

    # ------------------------------------------------------------------ GenerateBackend
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       priority: int = 0, cache_salt: str | None = None, tenant: str | None = None,
                       tenant_weight: float = 1.0) -> AsyncIterator[TokenDelta]:
        rt = tracing.current()  # the door's trace of this request (None: tracing off)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), len(prompt_token_ids), rt)
        timer = metrics.RequestTimer()
        t0 = time.time_ns()
        with self._cv:
            if self._closed:
                raise RuntimeError("the engine backend is shut down")
            if request_id in self._streams:
                raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
            if self.max_num_requests is not None and len(self._streams) >= self.max_num_requests:
                metrics.count_rejected()
                raise QueueFullError(
                    f"{len(self._streams)} requests in flight (limit {self.max_num_requests}); retry later",
                    self.retry_after_s)
            if self.max_queued_requests is not None and \
                    (queued := len(self._streams) - self.engine.num_running) >= self.max_queued_requests:
                # NOTE: num_running is read off the engine thread: a plain count, at worst one step old.
                metrics.count_rejected()
                raise QueueFullError(f"server busy: {queued} requests queued (max_queued_requests "
                                     f"{self.max_queued_requests}); retry later", self.retry_after_s)
            self._streams[request_id] = stream
            if rt is not None:
                tracing.stream_started()
            ids = list(prompt_token_ids)
            fair = dict(tenant=tenant, tenant_weight=tenant_weight)
            self.host.post(lambda eng: self._add(eng, request_id, ids, params, priority, cache_salt, fair))
        metrics.count_submitted()
        finished = False
        finish_reason: str | None = None
        num_cached: int | None = None
        num_tokens = 0
        try:
            while not finished:
                try:
                    item = stream.queue.get_nowait()
                except asyncio.QueueEmpty:
                    try:
                        # NOTE: `asyncio.timeout`, not `wait_for` (a task per wait); no timer at all
                        # for an event already queued.
                        async with asyncio.timeout(self.request_timeout_s):
                            item = await stream.queue.get()
                    except TimeoutError:
                        finish_reason = "error"
                        yield TokenDelta([], True, "error",
                                         f"no progress for {self.request_timeout_s:g}s (request_timeout_s)",
                                         stream.num_prompt_tokens)
                        return  # `finally` aborts it in the engine
                if isinstance(item, BaseException):
                    finished = True  # the engine rejected it: nothing to abort
                    raise item
                # Coalesce what piled up while the consumer was busy: fewer, larger events.
                while not item.finished and not stream.queue.empty():
                    nxt = stream.queue.get_nowait()
                    item.token_ids.extend(nxt.token_ids)
                    if item.logprobs is not None and nxt.logprobs is not None:
                        item.logprobs.extend(nxt.logprobs)
                    item.finished, item.finish_reason, item.error = nxt.finished, nxt.finish_reason, nxt.error
                finished = item.finished
                timer.tokens(len(item.token_ids))
                num_tokens += len(item.token_ids)
                if num_cached is None and item.token_ids:
                    num_cached = item.num_cached_tokens
                    if rt is not None:  # one engine computes it all: its queue and prefill end here
                        now = time.time_ns()
                        tracing.record("first_token", rt.span, now, now, {"cached_tokens": num_cached,
                                                                         "ttft_ms": round((now - t0) / 1e6, 3)})
                if finished:
                    finish_reason = item.finish_reason
                yield item
        finally:
            timer.finish(finish_reason, stream.num_prompt_tokens, num_cached or 0)
            if rt is not None:
                tracing.stream_finished(t0, finish_reason, stream.num_prompt_tokens, num_tokens, num_cached or 0)
            if not finished:
                self._abort_nowait(request_id)

    async def abort(self, request_id: str) -> None:
        self._abort_nowait(request_id)

    async def health(self) -> dict:
        eng = self.engine
        alive = self.host.alive and not self._closed
        return {
            "status": "ok" if alive and self.last_error is None else "unhealthy",
            "engine_thread_alive": alive,
            "num_requests": self.num_requests,
            "num_running": eng.num_running,
            "num_waiting": eng.num_waiting,
            "num_free_blocks": eng.block_manager.num_free_blocks,
            "num_blocks": eng.block_manager.num_blocks,
            "num_steps": self.num_steps,
            "last_error": self.last_error,
        }

    # ------------------------------------------------------------------ control
    @property
    def num_requests(self) -> int:
        """Requests in flight: accepted by `generate` and neither finished nor aborted."""
        return len(self._streams)

    @property
    def num_steps(self) -> int:
        return self.host.num_steps

    @property
    def last_error(self) -> str | None:
        return self.host.last_error

    @last_error.setter
    def last_error(self, value: str | None) -> None:
        self.host.last_error = value

    def run_on_engine(self, fn: Callable[[LLMEngine], Any]) -> concurrent.futures.Future:
        """Run `fn(engine)` on the engine thread between steps; the future holds its result."""
        if self._closed:
            raise RuntimeError("the engine backend is shut down")
        return self.host.post(fn)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Abort everything in flight and stop the engine thread."""
        self._closed = True
        self.host.stop(timeout_s)

    def _abort_nowait(self, request_id: str) -> None:
        # Synchronous on purpose: callable from a cancelled task's `finally` without awaiting.
        with self._cv:
            if self._streams.pop(request_id, None) is None:
                return  # finished or never known
        if not self._closed:
            self.host.post(lambda eng: eng.abort(request_id))

    # ------------------------------------------------------------------ engine thread (HostHooks)
    def _add(self, eng: LLMEngine, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
             priority: int, cache_salt: str | None, fair: dict) -> None:
        with self._cv:
            live = request_id in self._streams
        if not live:
            return  # aborted before it reached the engine
        try:
            eng.add_request(request_id, prompt_token_ids, params, priority=priority, cache_salt=cache_salt, **fair)
        except Exception as e:  # InvalidRequestError and friends: raised by generate()
            with self._cv:
                stream = self._streams.pop(request_id, None)
            if stream is not None:
                self._post(stream, e)

    def _deliver_step(self, outputs: list, stats: Any) -> None:
        self._idle_since = None
        self._record_metrics(stats)
        if waits := self._grammar_waits.take():  # before the outputs end their streams
            self._trace_grammar_waits(waits)
        for out in outputs:
            self._deliver(out.request_id, TokenDelta(
                list(out.new_token_ids), out.finished, out.finish_reason, out.error, out.num_prompt_tokens,
                out.num_cached_tokens, _list_or_none(out.logprobs), out.prompt_logprobs))

    def _trace_grammar_waits(self, waits: list) -> None:
        """A `grammar.compile` span under each traced request's root span (engine/grammar_waits.py)."""
        with self._cv:
            traces = [(w, s.trace) for w in waits if (s := self._streams.get(w.request_id)) is not None]
        for w, rt in traces:
            if rt is not None:
                tracing.record("grammar.compile", rt.span, tracing.seconds_ns(w.start_time),
                               tracing.seconds_ns(w.end_time), tracing.grammar_attributes(w))

    def _step_failed(self, exc: BaseException) -> None:
        # A bug or a device failure: the requests that step held end (with a generic message: the
        # exception text stays in the log); the others keep going. Every request if the step failed
        # before it scheduled.
        error = f"generation failed: the engine step failed ({type(exc).__name__})"
        held = self.engine.step_request_ids
        if held is None:
            self._fail_all("error", error)
            return
        for rid in held:
            self.engine.abort(rid)
            with self._cv:
                stream = self._streams.pop(rid, None)
            if stream is not None:
                self._post(stream, TokenDelta([], True, "error", error, stream.num_prompt_tokens))

    def _close_all(self) -> None:
        self._fail_all("abort", None)

    def _deliver(self, request_id: str, delta: TokenDelta) -> None:
        with self._cv:
            stream = self._streams.pop(request_id) if delta.finished else self._streams.get(request_id)
        if stream is not None:
            if not self._post(stream, delta) and not delta.finished:
                self._abort_nowait(request_id)

    @staticmethod
    def _post(stream: _Stream, item: TokenDelta | BaseException) -> bool:
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
            return True
        except RuntimeError:  # the caller's event loop is closed
            return False

    def _fail_all(self, finish_reason: str, error: str | None) -> None:
        with self._cv:
            streams, self._streams = self._streams, {}
        for rid, stream in streams.items():
            self.engine.abort(rid)
            self._post(stream, TokenDelta([], True, finish_reason, error, stream.num_prompt_tokens))

    def _record_metrics(self, stats: Any | None) -> None:
        """This layout's share of the Ray layouts' series (deployments/metrics.py): the engine's step
        and load as a worker's, its queue as a pool's (pool and worker_id: METRICS_POOL)."""
        eng = self.engine
        metrics.set_pool_state(METRICS_POOL, eng.num_waiting, 1)
        if stats is None:
            metrics.record_load(METRICS_POOL, METRICS_POOL, eng)
        else:
            metrics.record_step(METRICS_POOL, METRICS_POOL, stats, eng)

    def _idle_check(self) -> None:
        """Once the engine has been idle for a second (and every second after), check its KV cache."""
        self._record_metrics(None)
        now = time.monotonic()
        if self._idle_since is None or now - self._idle_since < IDLE_CHECK_S:
            self._idle_since = self._idle_since or now
            return
        self._idle_since = now
        if not self.idle_integrity_check:
            return
        try:
            self.engine.check_integrity()
        except AssertionError as e:
            logger.error("KV cache integrity check failed while idle: %s", e)
            self.last_error = "the KV cache integrity check failed; see the server log"
