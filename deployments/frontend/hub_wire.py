"""The token path's wire: workers (and the router) send `StreamEvent`s straight to the process of the
ingress replica that holds the request, over one authenticated TCP connection per sending process.

    decode / prefill worker ──HubClient.push──▶ (TCP, one connection per process and hub) ──▶ StreamHub
    router ──HubClient.delivered──▶ (a short connection, request and reply) ──▶ StreamHub
    worker ──HubClient.held──▶ (likewise, every few seconds) ──▶ StreamHub: which of its requests
                                                                  still have a client

NOTE: not a Ray actor call. With a StreamHub actor between the workers and the ingress, each engine
step cost two Ray calls (the worker's push, the ingress's long poll) and woke two more processes, on
the cores the engine steps on: about 4 core-ms per step on a 2-core host, a tenth of a decode step at
batch 1. A frame on a socket the sender keeps open costs a few tens of microseconds.

Security: the hub listens on its node's address only, and a connection must first answer a random
challenge with HMAC-SHA256 under the hub's 32-byte key, which travels only inside `GenRequest`s
(Ray's own authenticated channels). Frames are pickled, so nothing unauthenticated is ever unpickled.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import pickle
import queue
import socket
import struct
import threading
import time
from typing import Any, NamedTuple

logger = logging.getLogger(__name__)

_MAGIC = b"pdserve-hub/1"
_NONCE_BYTES = 32
_LEN = struct.Struct("!I")
MAX_FRAME_BYTES = 64 << 20
CONNECT_TIMEOUT_S = 5.0
RETRY_AFTER_S = 1.0  # a hub that could not be reached is tried again after this long
IDLE_CLOSE_S = 120.0  # a connection nothing was sent on for this long is closed (its thread ends)


class HubAddress(NamedTuple):
    """Where a StreamHub listens, and the key that opens it."""

    host: str
    port: int
    key: bytes

    def __repr__(self) -> str:  # never log the key
        return f"HubAddress({self.host}:{self.port})"


class WireError(ConnectionError):
    pass


def proof(key: bytes, nonce: bytes) -> bytes:
    return hmac.new(key, _MAGIC + nonce, hashlib.sha256).digest()


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise WireError("connection closed")
        buf += chunk
    return bytes(buf)


def send_frame(sock: socket.socket, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_LEN.pack(len(data)) + data)


def recv_frame(sock: socket.socket) -> Any:
    (n,) = _LEN.unpack(recv_exact(sock, _LEN.size))
    if n > MAX_FRAME_BYTES:
        raise WireError(f"frame of {n} bytes (most {MAX_FRAME_BYTES})")
    return pickle.loads(recv_exact(sock, n))


def connect(addr: HubAddress, timeout_s: float = CONNECT_TIMEOUT_S) -> socket.socket:
    """An authenticated connection to the hub at `addr` (blocking, `timeout_s` per operation)."""
    sock = socket.create_connection((addr.host, addr.port), timeout=timeout_s)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        nonce = recv_exact(sock, _NONCE_BYTES)
        sock.sendall(proof(addr.key, nonce))
        return sock
    except BaseException:
        sock.close()
        raise


class _Sender:
    """One process's connection to one hub, with a thread that sends what `push` queues, in order.
    Events queued while a frame is sent go out together in the next one. Idle for IDLE_CLOSE_S, it
    closes and leaves `client` (its hub's replica may be long gone)."""

    def __init__(self, addr: HubAddress, client: HubClient):
        self.addr = addr
        self.client = client
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.down_until = 0.0
        threading.Thread(target=self._run, name=f"hub-sender-{addr.host}:{addr.port}", daemon=True).start()

    def _next(self) -> list | None:
        """The next events to send, or None once idle (then this sender has left the client)."""
        while True:
            try:
                return self.queue.get(timeout=IDLE_CLOSE_S)
            except queue.Empty:
                if self.client.retire(self):
                    return None

    def _run(self) -> None:
        sock: socket.socket | None = None
        while True:
            first = self._next()
            if first is None:
                if sock is not None:
                    sock.close()
                return
            batch = list(first)
            while True:
                try:
                    batch.extend(self.queue.get_nowait())
                except queue.Empty:
                    break
            try:
                if sock is None:
                    sock = connect(self.addr)
                send_frame(sock, ("push", batch))
            except OSError as exc:
                logger.warning("stream hub %r unreachable (%r): %d events dropped", self.addr, exc, len(batch))
                if sock is not None:
                    sock.close()
                sock = None
                self.down_until = time.monotonic() + RETRY_AFTER_S


class HubClient:
    """Sends events to hubs from this process (workers, the router): `push` never blocks its caller."""

    def __init__(self) -> None:
        self._senders: dict[HubAddress, _Sender] = {}
        self._lock = threading.Lock()

    def push(self, addr: HubAddress | None, events: list) -> None:
        if addr is None:  # a request nobody streams (tests drive workers without an ingress)
            return
        with self._lock:
            sender = self._senders.get(addr)
            if sender is None:
                sender = self._senders[addr] = _Sender(addr, self)
            if time.monotonic() >= sender.down_until:  # else its hub is gone, and its streams with it
                sender.queue.put(events)

    def retire(self, sender: _Sender) -> bool:
        """Called by an idle sender: True if it left (nothing was queued for it meanwhile)."""
        with self._lock:
            if not sender.queue.empty():
                return False
            if self._senders.get(sender.addr) is sender:
                del self._senders[sender.addr]
            return True

    @staticmethod
    def delivered(addr: HubAddress, request_id: str, timeout_s: float = 10.0) -> list[int] | None:
        """The tokens the hub accepted for `request_id` (None: it has no such stream). Blocking."""
        with connect(addr, timeout_s) as sock:
            send_frame(sock, ("delivered", request_id))
            return recv_frame(sock)


    @staticmethod
    def held(addr: HubAddress, request_ids: list[str], timeout_s: float = 10.0) -> set[str]:
        """Which of `request_ids` the hub still streams (the others' clients are gone). Blocking;
        ConnectionRefusedError: nothing listens there any more (the replica is gone)."""
        with connect(addr, timeout_s) as sock:
            send_frame(sock, ("held", list(request_ids)))
            return set(recv_frame(sock))


_client: HubClient | None = None


def hub_client() -> HubClient:
    """This process's HubClient."""
    global _client
    if _client is None:
        _client = HubClient()
    return _client
