"""`RouterBackend`: the ingress's `GenerateBackend` over the router and this replica's StreamHub.

    generate ─▶ hub.open ─▶ router.submit (SubmitResult; refused: QueueFullError, the ingress's 429)
             ◀─ TokenDeltas ◀─ one long poll of the hub for all of this replica's streams (`_poll`)
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, AsyncIterator

import ray

from deployments import metrics
from deployments.frontend.backend import QueueFullError, TokenDelta
from deployments.cluster.messages import GenRequest, SubmitResult
from engine import SamplingParams

logger = logging.getLogger(__name__)

POLL_S = 1.0
_LOST = None  # put on a stream's queue when the hub is gone


class RouterBackend:
    """`GenerateBackend` for the Ray router: submits each request to the router and streams its tokens
    from this replica's StreamHub, where the workers push them."""

    def __init__(self, router: Any, hub: Any, hub_id: str, request_timeout_s: float = 300.0):
        self.router = router
        self.hub = hub
        self.hub_id = hub_id
        self.request_timeout_s = request_timeout_s
        self._queues: dict[str, asyncio.Queue] = {}
        self._poller: asyncio.Task | None = None
        self._consumer = f"{hub_id}-{uuid.uuid4().hex[:8]}"  # this backend's streams in the hub
        self._acked = 0  # hub sequence number of the last event received
        self._closing: set[asyncio.Task] = set()  # closes of streams whose client left during their open

    def _ensure_poller(self) -> None:
        """One long poll of the hub for every open stream of this replica (per event loop)."""
        if self._poller is None or self._poller.done() or self._poller.get_loop() is not asyncio.get_running_loop():
            self._poller = asyncio.get_running_loop().create_task(self._poll())

    async def _poll(self) -> None:
        while self._queues:
            try:
                batch, last = await self.hub.next_all.remote(self._consumer, self._acked, POLL_S)
            except ray.exceptions.RayActorError:  # the hub died (it lives with this replica): streams are lost
                logger.exception("stream hub %s is gone", self.hub_id)
                for q in self._queues.values():
                    q.put_nowait(_LOST)
                return
            except Exception:  # noqa: BLE001 - e.g. a transient RPC error: the events wait in the hub
                logger.warning("polling stream hub %s failed; retrying", self.hub_id, exc_info=True)
                await asyncio.sleep(0.05)
                continue
            self._acked = last
            for rid, events in batch.items():
                q = self._queues.get(rid)
                if q is not None:
                    q.put_nowait(events)

    async def _submit(self, req: GenRequest) -> asyncio.Queue:
        """Open `req`'s stream in the hub and hand it to the router; the queue its events arrive on.
        QueueFullError when the router refuses it."""
        opened = self.hub.open.remote(req.request_id, self._consumer)
        try:
            await opened
        except BaseException:  # the client left during the open: close the stream once it is open
            task = asyncio.get_running_loop().create_task(self._close_after(opened, req.request_id))
            self._closing.add(task)  # NOTE: the loop keeps only a weak reference to a task
            task.add_done_callback(self._closing.discard)
            raise
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[req.request_id] = queue
        try:
            res: SubmitResult = await self.router.submit.remote(req)
        except BaseException:  # the client left (cancelled) or the router failed during the submit
            self._queues.pop(req.request_id, None)
            self.hub.close.remote(req.request_id)
            raise
        if not res.accepted:
            self._queues.pop(req.request_id, None)
            await self.hub.close.remote(req.request_id)
            raise QueueFullError(f"server busy: {res.reason or 'queue full'}", res.retry_after_s or 1.0)
        return queue

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       priority: int = 0, cache_salt: str | None = None) -> AsyncIterator[TokenDelta]:
        timer = metrics.RequestTimer()
        queue = await self._submit(GenRequest(request_id, list(prompt_token_ids), params, self.hub_id, self.hub,
                                              priority=priority, num_original_prompt_tokens=len(prompt_token_ids),
                                              arrival_time=time.time(), cache_salt=cache_salt))
        finished = False
        finish_reason = None
        num_cached: int | None = None  # the first prefill's prefix-cache hits (the first event with tokens)
        last_event = time.monotonic()
        self._ensure_poller()
        try:
            while not finished:
                try:
                    events = await asyncio.wait_for(queue.get(), POLL_S)
                except asyncio.TimeoutError:
                    events = []
                    self._ensure_poller()
                if events is _LOST:
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
            self._queues.pop(request_id, None)
            timer.finish(finish_reason, len(prompt_token_ids), num_cached or 0)
            if not finished:
                await self.abort(request_id)
            else:  # NOTE: the hub keeps a finished stream until acknowledged; close it now, not at the next poll
                self.hub.close.remote(request_id)

    async def _close_after(self, opened: Any, request_id: str) -> None:
        """Close a stream whose `open` call is under way. NOTE: the hub is an async actor, which may run
        a `close` sent later before that `open` (Ray orders an async actor's calls only by arrival),
        leaving the stream open for good: found by tests/e2e/test_soak.py."""
        try:
            await asyncio.wait_for(opened, 30)
        except Exception:  # noqa: BLE001 - the hub is gone or stuck: nothing to close, or it will be swept
            return
        self.hub.close.remote(request_id)

    async def abort(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        self.router.abort.remote(request_id)
        self.hub.close.remote(request_id)

    async def health(self) -> dict:
        stats = await self.router.stats.remote()
        return {"status": "ok", "router": stats}
