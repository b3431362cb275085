"""In-process transport: queues between named endpoints of one process, for tests without Ray or sockets.

`InProcHub.kill(name)` makes every peer of `name` see it die (`PeerDiedError`), as a dead actor would.
"""

from __future__ import annotations

import queue
import threading
from collections import deque

import torch

from kv_transfer.errors import KVTransferError, PeerDiedError, TransferTimeoutError
from kv_transfer.transport import Channel, Pending, Transport


class InProcHub:
    """Queues between named in-process endpoints; `kill(name)` makes its peers see it die."""

    def __init__(self) -> None:
        self._queues: dict[tuple[str, str], queue.Queue] = {}
        self._dead: set[str] = set()
        self._lock = threading.Lock()

    def queue(self, src: str, dst: str) -> queue.Queue:
        with self._lock:
            return self._queues.setdefault((src, dst), queue.Queue())

    def kill(self, name: str) -> None:
        with self._lock:
            self._dead.add(name)
            queues = [q for (s, d), q in self._queues.items() if name in (s, d)]
        for q in queues:
            q.put(_DEAD)

    def is_dead(self, name: str) -> bool:
        return name in self._dead


_DEAD = object()


class _Done:
    def wait(self, timeout_s: float) -> None:
        return None


class _InProcRecv:
    def __init__(self, channel: _InProcChannel, tensor: torch.Tensor):
        self.channel, self.tensor, self.done = channel, tensor, False

    def wait(self, timeout_s: float) -> None:
        # Complete earlier receives first: messages match posted receives in order.
        while not self.done:
            self.channel._complete_next(timeout_s)


class _InProcChannel(Channel):
    def __init__(self, hub: InProcHub, me: str, peer: str):
        super().__init__(peer)
        self.hub, self.me = hub, me
        self._out = hub.queue(me, peer)
        self._in = hub.queue(peer, me)
        self._posted: deque[_InProcRecv] = deque()

    def _check_alive(self) -> None:
        if self.hub.is_dead(self.peer) or self.hub.is_dead(self.me):
            raise PeerDiedError(f"{self.me}: peer {self.peer!r} died")

    def isend(self, tensor: torch.Tensor, tag: int = 0) -> Pending:
        self._check_alive()
        self._out.put(tensor.detach().clone())
        return _Done()

    def irecv(self, tensor: torch.Tensor, tag: int = 0) -> Pending:
        p = _InProcRecv(self, tensor)
        self._posted.append(p)
        return p

    def _complete_next(self, timeout_s: float) -> None:
        self._check_alive()
        try:
            msg = self._in.get(timeout=timeout_s)
        except queue.Empty:
            raise TransferTimeoutError(f"{self.me}: nothing from {self.peer!r} in {timeout_s:.1f}s") from None
        if msg is _DEAD:
            raise PeerDiedError(f"{self.me}: peer {self.peer!r} died")
        p = self._posted.popleft()
        if msg.shape != p.tensor.shape or msg.dtype != p.tensor.dtype:
            raise KVTransferError(f"{self.me}: got {tuple(msg.shape)} {msg.dtype} from {self.peer!r}, "
                                  f"expected {tuple(p.tensor.shape)} {p.tensor.dtype}")
        p.tensor.copy_(msg)
        p.done = True

    def close(self) -> None:
        super().close()
        while True:  # a later channel between the same names must not read this one's leftovers
            try:
                self._in.get_nowait()
            except queue.Empty:
                break


class InProcTransport(Transport):
    """Channels over an `InProcHub`; both ends just `connect`. For tests without Ray or sockets."""

    def __init__(self, hub: InProcHub, name: str):
        super().__init__()
        self.hub, self.name = hub, name

    def connect(self, peer: str) -> None:
        if not self.has_channel(peer):
            self._add(_InProcChannel(self.hub, self.name, peer))
