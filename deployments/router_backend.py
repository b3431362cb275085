"""`RouterBackend`: the ingress's `GenerateBackend` over the router and this replica's StreamHub."""

from __future__ import annotations

import time
from typing import Any, AsyncIterator

from deployments import metrics
from deployments.backend import QueueFullError, TokenDelta
from deployments.messages import GenRequest
from engine import SamplingParams

POLL_S = 1.0


class RouterBackend:
    def __init__(self, router: Any, hub: Any, hub_id: str, request_timeout_s: float = 300.0):
        self.router = router
        self.hub = hub
        self.hub_id = hub_id
        self.request_timeout_s = request_timeout_s

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       priority: int = 0) -> AsyncIterator[TokenDelta]:
        timer = metrics.RequestTimer()
        await self.hub.open.remote(request_id)
        req = GenRequest(request_id, list(prompt_token_ids), params, self.hub_id, self.hub, priority=priority,
                         num_original_prompt_tokens=len(prompt_token_ids), arrival_time=time.time())
        res = await self.router.submit.remote(req)
        if not res["ok"]:
            await self.hub.close.remote(request_id)
            raise QueueFullError(f"server busy: {res.get('reason', 'queue full')}", res.get("retry_after_s", 1.0))
        finished = False
        finish_reason = None
        last_event = time.monotonic()
        try:
            while not finished:
                events = await self.hub.next.remote(request_id, POLL_S)
                if events is None:
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
                    if finished:
                        finish_reason = ev.finish_reason
                    yield TokenDelta(list(ev.token_ids), ev.finished, ev.finish_reason, ev.error,
                                     ev.num_prompt_tokens or len(prompt_token_ids))
                    if finished:
                        break
        finally:
            timer.finish(finish_reason, len(prompt_token_ids))
            if not finished:
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        self.router.abort.remote(request_id)
        self.hub.close.remote(request_id)

    async def health(self) -> dict:
        stats = await self.router.stats.remote()
        return {"status": "ok", "router": stats}
