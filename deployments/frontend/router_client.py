"""`RouterBackend`: the ingress's `GenerateBackend` over the router and this replica's StreamHub.

    generate ─▶ hub.open ─▶ router.submit (SubmitResult; refused: QueueFullError, the ingress's 429)
             ◀─ TokenDeltas ◀─ the stream's queue, which the hub (in this process) fills as workers send
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator

from deployments import metrics, tracing
from deployments.frontend.backend import QueueFullError, TokenDelta
from deployments.cluster.messages import GenRequest, SubmitResult
from deployments.frontend.stream_hub import LOST, StreamHub
from engine import SamplingParams

logger = logging.getLogger(__name__)

POLL_S = 1.0  # how often a waiting stream checks request_timeout_s


class RouterBackend:
    """`GenerateBackend` for the Ray router: submits each request to the router and streams its tokens
    from `hub`, this replica's StreamHub (in this process), where the workers send them."""

    def __init__(self, router: Any, hub: StreamHub, hub_id: str, request_timeout_s: float = 300.0):
        self.router = router
        self.hub = hub
        self.hub_id = hub_id
        self.request_timeout_s = request_timeout_s

    async def _submit(self, req: GenRequest) -> asyncio.Queue:
        """Open `req`'s stream in the hub and hand it to the router; the queue its events arrive on.
        QueueFullError when the router refuses it."""
        queue = self.hub.open(req.request_id)
        try:
            res: SubmitResult = await self.router.submit.remote(req)
        except BaseException:  # the client left (cancelled) or the router failed during the submit
            self.hub.close(req.request_id)
            # NOTE: the submit may have reached the router (and been queued) all the same. Ray may run
            # this abort before it (an async actor's calls need not start in order): the router then
            # keeps the id and drops the submit when it arrives (`RouterState.early_aborts`).
            self.router.abort.remote(req.request_id)
            raise
        if not res.accepted:
            self.hub.close(req.request_id)
            raise QueueFullError(f"server busy: {res.reason or 'queue full'}", res.retry_after_s or 1.0)
        return queue

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       priority: int = 0, cache_salt: str | None = None, tenant: str | None = None,
                       tenant_weight: float = 1.0) -> AsyncIterator[TokenDelta]:
        timer = metrics.RequestTimer()
        t0 = time.time_ns()
        trace = tracing.stream_started()  # None unless tracing is on and the door traces this request
        try:
            queue = await self._submit(GenRequest(request_id, list(prompt_token_ids), params, self.hub_id,
                                                  self.hub.address, priority=priority,
                                                  num_original_prompt_tokens=len(prompt_token_ids),
                                                  arrival_time=time.time(), cache_salt=cache_salt, trace=trace,
                                                  tenant=tenant, tenant_weight=tenant_weight))
        except BaseException as e:
            if trace is not None:
                tracing.stream_finished(t0, "rejected" if isinstance(e, QueueFullError) else "error",
                                        len(prompt_token_ids), 0)
            raise
        finished = False
        finish_reason = None
        num_cached: int | None = None  # the first prefill's prefix-cache hits (the first event with tokens)
        num_tokens = 0
        last_event = time.monotonic()
        try:
            while not finished:
                # NOTE: a ready event is taken without a timer; `asyncio.timeout` rather than `wait_for`,
                # which wraps every wait in a task of its own (per stream, per step, on the ingress's core).
                try:
                    events = queue.get_nowait()
                except asyncio.QueueEmpty:
                    try:
                        async with asyncio.timeout(POLL_S):
                            events = await queue.get()
                    except TimeoutError:
                        events = []
                if events is LOST:
                    finish_reason = "error"
                    yield TokenDelta([], True, "error", "request stream lost", len(prompt_token_ids))
                    return
                if not events:
                    if time.monotonic() - last_event > self.request_timeout_s:
                        finish_reason = "error"
                        yield TokenDelta([], True, "error",
                                         f"no progress for {self.request_timeout_s:.0f}s (request_timeout_s)",
                                         len(prompt_token_ids))
                        return
                    continue
                last_event = time.monotonic()
                for ev in events:
                    finished = ev.finished
                    timer.tokens(len(ev.token_ids))
                    num_tokens += len(ev.token_ids)
                    if num_cached is None and ev.token_ids:
                        num_cached = ev.num_cached_tokens
                    if finished:
                        finish_reason = ev.finish_reason
                    yield TokenDelta(list(ev.token_ids), ev.finished, ev.finish_reason, ev.error,
                                     ev.num_prompt_tokens or len(prompt_token_ids), ev.num_cached_tokens,
                                     ev.logprobs, ev.prompt_logprobs)
                    if finished:
                        break
        finally:
            timer.finish(finish_reason, len(prompt_token_ids), num_cached or 0)
            if trace is not None:
                tracing.stream_finished(t0, finish_reason, len(prompt_token_ids), num_tokens, num_cached or 0)
            self.hub.close(request_id)
            if not finished:
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        self.hub.close(request_id)
        self.router.abort.remote(request_id)

    async def health(self) -> dict:
        stats = await self.router.stats.remote()
        return {"status": "ok", "router": stats}
