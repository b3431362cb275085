"""One `StreamHub` actor per front-door replica (HTTP or gRPC): workers push tokens into it, the
replica's `RouterBackend` (router_client.py) long-polls it.

    prefill worker ──first token──▶ ┐
    decode worker ──tokens/step───▶ ├─▶ StreamHub (dedupe by offset) ◀── next_all() ── door replica
    (a migrated request's new worker) ┘

The router never sees a token. A Serve replica cannot be called by other actors directly, so the
hub stands in for it; it lives and dies with the replica that created it. The replica has one poll
in flight for all of its streams, not one per request: with many concurrent streams, a call per
request per step cost more CPU than the tokens themselves. Reads are acknowledged: an event stays in
the hub until its consumer's next poll says it got it, so a poll whose caller went away (a cancelled
task, a closed event loop) loses nothing.

Nothing stays behind: a stream leaves when its consumer acknowledges its last event, when the
consumer closes it (client gone, refused at submit), or, finished but never acknowledged (the
consumer stopped polling), `done_ttl_s` after its last event.
"""

from __future__ import annotations

import asyncio
import time

import ray

from deployments.cluster.messages import StreamEvent


class _Stream:
    __slots__ = ("owner", "queue", "next_offset", "done", "touched", "delivered", "early")

    def __init__(self, owner: str) -> None:
        self.owner = owner  # the consumer (RouterBackend) that polls this stream
        self.queue: list[tuple[int, StreamEvent]] = []  # (hub sequence number, event), not yet acknowledged
        self.next_offset = 0
        self.done = False
        self.touched = time.monotonic()
        self.delivered: list[int] = []  # every token accepted so far (what a migration resumes from)
        self.early: list[StreamEvent] = []  # events that arrived before the ones they follow


# A finished stream nobody acknowledged is dropped this long after its last event.
DONE_TTL_S = 60.0
_SWEEP_EVERY_S = 1.0


@ray.remote(num_cpus=0, max_restarts=0)
class StreamHub:
    def __init__(self, done_ttl_s: float = DONE_TTL_S) -> None:
        self._streams: dict[str, _Stream] = {}
        self._cond = asyncio.Condition()
        self._seq = 0
        self._done_ttl_s = done_ttl_s
        self._last_sweep = time.monotonic()

    async def open(self, request_id: str, owner: str = "") -> None:
        self._sweep()
        self._streams[request_id] = _Stream(owner)

    def _sweep(self) -> None:
        """Drop finished streams whose consumer stopped polling before acknowledging them."""
        now = time.monotonic()
        if now - self._last_sweep < min(_SWEEP_EVERY_S, self._done_ttl_s):
            return
        self._last_sweep = now
        for rid in [rid for rid, s in self._streams.items() if s.done and now - s.touched > self._done_ttl_s]:
            del self._streams[rid]

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

    def _accept(self, s: _Stream, ev: StreamEvent) -> None:
        # NOTE: drop what the client already has (a migrated request restarts from `offset`).
        skip = s.next_offset - ev.offset
        if skip > 0:
            ev.token_ids = ev.token_ids[skip:]
            if ev.logprobs is not None:
                ev.logprobs = ev.logprobs[skip:]  # aligned with token_ids
            ev.offset += skip
        s.next_offset += len(ev.token_ids)
        s.delivered.extend(ev.token_ids)
        if ev.token_ids or ev.finished:
            self._seq += 1
            s.queue.append((self._seq, ev))
        s.done = ev.finished
        s.touched = time.monotonic()

    async def delivered(self, request_id: str) -> list[int] | None:
        """Tokens accepted for `request_id` so far (None if unknown): a migration resumes after them."""
        s = self._streams.get(request_id)
        return None if s is None else list(s.delivered)

    async def next_all(self, owner: str, ack: int, timeout_s: float) -> tuple[dict[str, list[StreamEvent]], int]:
        """Everything after sequence number `ack` on `owner`'s streams, waiting up to `timeout_s` for
        something: ({request_id: events}, the last sequence number in it). Passing `ack` says every
        event up to it was received: those are dropped, and finished streams with them."""
        deadline = time.monotonic() + timeout_s
        self._sweep()
        async with self._cond:
            while True:
                out: dict[str, list[StreamEvent]] = {}
                last = ack
                for rid, s in list(self._streams.items()):
                    if s.owner != owner:
                        continue
                    if s.queue and s.queue[0][0] <= ack:
                        s.queue = [(q, ev) for q, ev in s.queue if q > ack]
                    if not s.queue:
                        if s.done:
                            del self._streams[rid]
                        continue
                    out[rid] = [ev for _, ev in s.queue]
                    last = max(last, s.queue[-1][0])
                if out:
                    return out, last
                left = deadline - time.monotonic()
                if left <= 0:
                    return {}, ack
                try:
                    await asyncio.wait_for(self._cond.wait(), left)
                except asyncio.TimeoutError:
                    return {}, ack

    async def close(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    async def num_streams(self) -> int:
        """Streams held (a leak check: 0 once every request ended and its consumer caught up)."""
        self._sweep()
        return len(self._streams)
