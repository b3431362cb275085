"""The transport interface: pairwise channels, one per peer, created lazily and cached.

Backends: `InProcTransport` (queues; unit tests), `GlooTransport` (CPU, kv_transfer.gloo),
`NcclTransport` (GPU, kv_transfer.nccl). The protocol (kv_transfer.protocol) only uses what is here.
Gloo and NCCL open channels the same way: the exporting side `listen(peer)` returns an opaque,
picklable address, the importing side `connect(peer, address)`; `make_transport` picks the backend
from the device the KV cache lives on.
"""

from __future__ import annotations

import queue
import threading
from abc import ABC, abstractmethod
from collections import deque
from typing import Protocol

import torch

from kv_transfer.errors import KVTransferError, PeerDiedError, TransferTimeoutError


class Pending(Protocol):
    def wait(self, timeout_s: float) -> None:
        """Block until the operation is done; `TransferTimeoutError` / `PeerDiedError` otherwise."""


class Channel(ABC):
    """An ordered, bidirectional pipe of tensors to one peer.

    Messages are matched in order, so only one transfer may use a channel at a time: hold `lock`
    for the whole header-blocks-ack exchange. After any error the stream may be out of step: the
    transport drops the channel and a later transfer opens a fresh one.
    """

    # True where operations run one after another in the order they were posted (NCCL on one CUDA
    # stream): a receive posted ahead of this side's sends would then hold those sends back.
    serial = False

    def __init__(self, peer: str):
        self.peer = peer
        self.lock = threading.Lock()
        self.broken = False

    # `tag` names a message in a stream: a receive only matches the send with its tag. Backends whose
    # sends complete in order whatever their sizes (NCCL on one stream, in-process queues) ignore it.
    @abstractmethod
    def isend(self, tensor: torch.Tensor, tag: int = 0) -> Pending: ...

    @abstractmethod
    def irecv(self, tensor: torch.Tensor, tag: int = 0) -> Pending: ...

    def close(self) -> None:
        self.broken = True


class Transport(ABC):
    """Channels by peer id. Subclasses add how a channel is opened (listen/connect, unique ids...)."""

    def __init__(self) -> None:
        self._channels: dict[str, Channel] = {}
        self._lock = threading.Lock()

    def has_channel(self, peer: str) -> bool:
        with self._lock:
            ch = self._channels.get(peer)
            return ch is not None and not ch.broken

    def channel(self, peer: str) -> Channel:
        with self._lock:
            ch = self._channels.get(peer)
        if ch is None or ch.broken:
            raise KVTransferError(f"no open channel to {peer!r}; open one first")
        return ch

    def _add(self, channel: Channel) -> None:
        with self._lock:
            old = self._channels.get(channel.peer)
            self._channels[channel.peer] = channel
        if old is not None and old is not channel:
            old.close()

    def drop(self, peer: str, channel: Channel | None = None) -> None:
        """Close the channel to `peer` (only if it is still `channel`, when given)."""
        with self._lock:
            ch = self._channels.get(peer)
            if ch is None or (channel is not None and ch is not channel):
                ch = channel
            else:
                del self._channels[peer]
        if ch is not None:
            ch.close()

    def close(self) -> None:
        with self._lock:
            channels = list(self._channels.values())
            self._channels.clear()
        for ch in channels:
            ch.close()

    def send(self, tensor: torch.Tensor, peer: str, timeout_s: float) -> None:
        self.channel(peer).isend(tensor).wait(timeout_s)

    def recv(self, tensor: torch.Tensor, peer: str, timeout_s: float) -> None:
        self.channel(peer).irecv(tensor).wait(timeout_s)


# ---------------------------------------------------------------------------------- in-process
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


def make_transport(device: torch.device | str, host: str, timeout_s: float = 30.0) -> Transport:
    """The transport for a KV cache on `device`: NCCL for CUDA tensors, gloo for CPU tensors.

    `host` is this node's address as peers reach it (gloo binds its store there; NCCL ignores it).
    """
    device = torch.device(device)
    if device.type == "cuda":
        from kv_transfer.nccl import NcclTransport

        return NcclTransport(device, timeout_s)
    if device.type == "cpu":
        from kv_transfer.gloo import GlooTransport

        return GlooTransport(host, timeout_s)
    raise ValueError(f"no KV transport for device type {device.type!r} (cpu: gloo, cuda: nccl)")
