"""One `StreamHub` actor per ingress replica: workers push tokens into it, the replica long-polls it.

    prefill worker ──first token──▶ ┐
    decode worker ──tokens/step───▶ ├─▶ StreamHub (dedupe by offset) ◀── next_all() ── ingress replica
    (a migrated request's new worker) ┘

The router never sees a token. A Serve replica cannot be called by other actors directly, so the
hub stands in for it; it lives and dies with the replica that created it. The replica has one poll
in flight for all of its streams, not one per request: with many concurrent streams, a call per
request per step cost more CPU than the tokens themselves (see RouterBackend).
"""

from __future__ import annotations

import asyncio
import time

import ray

from deployments.messages import StreamEvent


class _Stream:
    __slots__ = ("queue", "next_offset", "done", "touched", "delivered", "early")

    def __init__(self) -> None:
        self.queue: list[StreamEvent] = []
        self.next_offset = 0
        self.done = False
        self.touched = time.monotonic()
        self.delivered: list[int] = []  # every token accepted so far (what a migration resumes from)
        self.early: list[StreamEvent] = []  # events that arrived before the ones they follow


@ray.remote(num_cpus=0, max_restarts=0)
class StreamHub:
    def __init__(self) -> None:
        self._streams: dict[str, _Stream] = {}
        self._cond = asyncio.Condition()

    async def open(self, request_id: str) -> None:
        self._streams[request_id] = _Stream()

    async def push(self, events: list[StreamEvent]) -> None:
        """Called fire-and-forget by workers, once per step with all of that step's events."""
        async with self._cond:
            for ev in events:
                s = self._streams.get(ev.request_id)
                if s is None or s.done:
                    continue
                if ev.offset > s.next_offset:
                    s.early.append(ev)  # e.g. a decode step overtook the prefill's first token
                    continue
                self._accept(s, ev)
                progressed = True
                while progressed and s.early and not s.done:
                    progressed = False
                    for e in list(s.early):
                        if e.offset <= s.next_offset:
                            s.early.remove(e)
                            self._accept(s, e)
                            progressed = True
            self._cond.notify_all()

    @staticmethod
    def _accept(s: _Stream, ev: StreamEvent) -> None:
        # NOTE: drop what the client already has (a migrated request restarts from `offset`).
        skip = s.next_offset - ev.offset
        if skip > 0:
            ev.token_ids = ev.token_ids[skip:]
            ev.offset += skip
        s.next_offset += len(ev.token_ids)
        s.delivered.extend(ev.token_ids)
        if ev.token_ids or ev.finished:
            s.queue.append(ev)
        s.done = ev.finished
        s.touched = time.monotonic()

    async def delivered(self, request_id: str) -> list[int] | None:
        """Tokens accepted for `request_id` so far (None if unknown): a migration resumes after them."""
        s = self._streams.get(request_id)
        return None if s is None else list(s.delivered)

    async def next_all(self, timeout_s: float) -> dict[str, list[StreamEvent]]:
        """Everything new on every stream, waiting up to `timeout_s` for something; {} on timeout.
        A hub has one consumer (its replica's RouterBackend): what this returns is gone from the hub."""
        deadline = time.monotonic() + timeout_s
        async with self._cond:
            while True:
                out = {}
                for rid, s in list(self._streams.items()):
                    if s.queue:
                        out[rid], s.queue = s.queue, []
                        if s.done:
                            del self._streams[rid]
                if out:
                    return out
                left = deadline - time.monotonic()
                if left <= 0:
                    return {}
                try:
                    await asyncio.wait_for(self._cond.wait(), left)
                except asyncio.TimeoutError:
                    return {}

    async def close(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    async def num_streams(self) -> int:
        return len(self._streams)
