"""The transport interface: pairwise channels, one per peer, created lazily and cached.

Backends: `InProcTransport` (queues; unit tests, kv_transfer.inproc), `GlooTransport` (CPU,
kv_transfer.gloo), `NcclTransport` (GPU, kv_transfer.nccl); each imports this module, never the
reverse. The protocol (kv_transfer.protocol) only uses what is here. Gloo and NCCL open channels the
same way: the exporting side `listen(peer)` returns an opaque, picklable address, the importing side
`connect(peer, address)`; `kv_transfer.factory.make_transport` picks the backend from the device the
KV cache lives on.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from typing import Protocol

import torch

from kv_transfer.errors import KVTransferError


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
