"""One `StreamHub` per front-door replica (HTTP or gRPC), in the replica's own process: workers send
tokens to it over the wire (hub_wire.py), and it hands them to the replica's streams.

    prefill worker ──first token──▶ ┐
    decode worker ──tokens/step───▶ ├─▶ (TCP) StreamHub (dedupe by offset) ──▶ the request's asyncio.Queue
    (a migrated request's new worker) ┘
    router ──delivered(request id)──▶ StreamHub: the tokens the client has (a migration resumes after them)

The router never sees a token. The hub listens on its node's address, on a port of its own, and
serves only connections that prove they hold its key (hub_wire.py). A thread accepts connections
and one thread per connection (one per sending process) reads its frames; events reach a stream's
queue through its event loop's `call_soon_threadsafe`.

Nothing stays behind: a stream leaves when its last event is accepted, or when its consumer closes
it (client gone, refused at submit). Events of streams the hub does not hold are dropped. Workers ask
which of their requests still have a stream (`held`): one without is aborted there, even if the
client's abort never arrived (engine_worker.py, `_sweep_orphans`).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import secrets
import socket
import threading
from typing import Any

from deployments.cluster.messages import StreamEvent
from deployments.frontend.hub_wire import HubAddress, WireError, proof, recv_exact, recv_frame, send_frame

logger = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 10.0
LOST = None  # put on every open stream's queue when the hub shuts down


class _Stream:
    __slots__ = ("queue", "loop", "next_offset", "delivered", "early")

    def __init__(self, queue: asyncio.Queue, loop: asyncio.AbstractEventLoop) -> None:
        self.queue = queue
        self.loop = loop
        self.next_offset = 0
        self.delivered: list[int] = []  # every token accepted so far (what a migration resumes from)
        self.early: list[StreamEvent] = []  # events that arrived before the ones they follow


def _bind_address() -> str:
    """This node's address as Ray knows it (other nodes' workers reach it), else loopback."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001
        pass
    return "127.0.0.1"


class StreamHub:
    """The streams of one front-door replica; `address` is what `GenRequest.hub` carries."""

    def __init__(self, host: str | None = None) -> None:
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._key = secrets.token_bytes(32)
        self._sock = socket.create_server((host or _bind_address(), 0))
        self._closed = False
        self.address = HubAddress(self._sock.getsockname()[0], self._sock.getsockname()[1], self._key)
        threading.Thread(target=self._listen, name="stream-hub-listen", daemon=True).start()

    # ------------------------------------------------------------------ consumer side (this process)
    def open(self, request_id: str) -> asyncio.Queue:
        """A new stream for `request_id` on the running event loop: its events arrive on the queue
        (lists of StreamEvent; LOST if the hub shuts down)."""
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self._streams[request_id] = _Stream(q, asyncio.get_running_loop())
        return q

    def close(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)

    def delivered(self, request_id: str) -> list[int] | None:
        """Tokens accepted for `request_id` so far (None if unknown): a migration resumes after them."""
        with self._lock:
            s = self._streams.get(request_id)
            return None if s is None else list(s.delivered)

    def held(self, request_ids: list[str]) -> list[str]:
        """Those of `request_ids` that still have a stream here (a consumer, or events to come)."""
        with self._lock:
            return [rid for rid in request_ids if rid in self._streams]

    def num_streams(self) -> int:
        """Streams held (a leak check: 0 once every request ended)."""
        with self._lock:
            return len(self._streams)

    def shutdown(self) -> None:
        self._closed = True
        # NOTE: close() alone leaves the socket listening while `_listen` is blocked in accept(); a
        # connection that came then was accepted and dropped instead of refused (a worker asking
        # whether its clients are still here must hear "refused": the replica is gone).
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
        for s in streams:
            self._deliver(s, LOST)

    # ------------------------------------------------------------------ producer side
    def push(self, events: list[StreamEvent]) -> None:
        """Accept `events` (from the wire, or from this process): in offset order, once each."""
        ready: list[tuple[_Stream, list[StreamEvent]]] = []
        with self._lock:
            out: dict[str, list[StreamEvent]] = {}
            for ev in events:
                s = self._streams.get(ev.request_id)
                if s is None:
                    continue
                if ev.offset > s.next_offset:
                    s.early.append(ev)  # e.g. a decode step overtook the prefill's first token
                    continue
                accepted = out.setdefault(ev.request_id, [])
                self._accept(s, ev, accepted)
                progressed = True
                while progressed and s.early and not (accepted and accepted[-1].finished):
                    progressed = False
                    for e in list(s.early):
                        if e.offset <= s.next_offset:
                            s.early.remove(e)
                            self._accept(s, e, accepted)
                            progressed = True
            for rid, evs in out.items():
                if evs:
                    s = self._streams[rid]
                    if evs[-1].finished:
                        del self._streams[rid]  # NOTE: later events for it (a late duplicate) are dropped
                    ready.append((s, evs))
        for s, evs in ready:
            self._deliver(s, evs)

    @staticmethod
    def _accept(s: _Stream, ev: StreamEvent, accepted: list[StreamEvent]) -> None:
        if accepted and accepted[-1].finished:
            return
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
            accepted.append(ev)

    @staticmethod
    def _deliver(s: _Stream, item: Any) -> None:
        try:
            s.loop.call_soon_threadsafe(s.queue.put_nowait, item)
        except RuntimeError:  # the consumer's event loop is closed: nobody reads this stream
            pass

    # ------------------------------------------------------------------ the wire
    def _listen(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # shut down
            threading.Thread(target=self._serve, args=(conn,), name="stream-hub-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        """One connection: the handshake, then frames until it closes."""
        with conn:
            try:
                conn.settimeout(HANDSHAKE_TIMEOUT_S)
                nonce = os.urandom(32)
                conn.sendall(nonce)
                if not hmac.compare_digest(recv_exact(conn, 32), proof(self._key, nonce)):
                    logger.warning("stream hub: a connection failed the handshake; closed")
                    return
                conn.settimeout(None)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                while not self._closed:
                    op, arg = recv_frame(conn)
                    if op == "push":
                        self.push(arg)
                    elif op == "delivered":
                        send_frame(conn, self.delivered(arg))
                    elif op == "held":
                        send_frame(conn, self.held(arg))
            except (OSError, WireError, EOFError):
                return
            except Exception:  # noqa: BLE001 - a bad frame ends its connection, never the hub
                logger.exception("stream hub: connection failed")
