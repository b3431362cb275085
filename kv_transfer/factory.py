"""Which transport a KV cache gets, per peer: the top of kv_transfer's imports (it knows every backend,
none knows it).

A worker's `DeviceTransport` holds one channel per peer, each over the backend that pair of devices
needs (`choose_transport`):

    this cache   peer's device              backend
    cpu          any                        gloo
    cuda         another GPU (its own id)   NCCL (kv_transfer.nccl)
    cuda         the same GPU (same id)     gloo through pinned host memory (kv_transfer.staged):
                                            NCCL cannot pair two ranks on one device
    cuda         a CPU (no id)              gloo through pinned host memory

The exporting side chooses when it `listen`s (the importer sends its device id along) and the address
says which wire (NCCL or gloo) to `connect` with; each side maps a gloo wire to plain gloo on CPU and
to staged gloo on CUDA, so the two ends always speak the same wire.

Importing kv_transfer.nccl needs no GPU: cupy loads only when a channel opens.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from kv_transfer.gloo import GlooTransport
from kv_transfer.nccl import NcclTransport
from kv_transfer.staged import StagedTransport
from kv_transfer.transport import Transport


class TransportKind(Enum):
    """The backend of one channel."""

    GLOO = "gloo"  # CPU tensors over gloo
    NCCL = "nccl"  # GPU to GPU over NCCL
    STAGED = "staged"  # GPU tensors over gloo, through pinned host memory

    @property
    def wire(self) -> str:
        """What the other end must speak: NCCL, or gloo (plain or staged alike)."""
        return "nccl" if self is TransportKind.NCCL else "gloo"


@dataclass(frozen=True, slots=True)
class PairAddress:
    """What the exporter's `listen` hands the importer (through a Ray call): the wire and its address
    (gloo: (host, port); NCCL: the unique id)."""

    wire: str
    address: Any


def device_id(device: torch.device | str) -> str | None:
    """A GPU's identity across processes and nodes (its UUID: Ray renumbers each actor's visible
    GPUs from 0, so the index says nothing); None for a CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device if device.index is not None else torch.cuda.current_device())
    return f"GPU-{props.uuid}"


def choose_transport(device_type: str, mine: str | None, peer: str | None) -> TransportKind:
    """The backend for a channel between this cache (`device_type`, device id `mine`) and a peer's
    cache on device `peer` (None: a CPU)."""
    if device_type == "cpu":
        return TransportKind.GLOO
    if device_type != "cuda":
        raise ValueError(f"no KV transport for device type {device_type!r} (cpu: gloo, cuda: nccl)")
    if peer is None or peer == mine:
        return TransportKind.STAGED
    return TransportKind.NCCL


class DeviceTransport(Transport):
    """The channels of one KV cache on `device`, each over the backend its pair of devices needs.

    `host` is this node's address as peers reach it (gloo binds there; NCCL ignores it)."""

    def __init__(self, device: torch.device | str, host: str, timeout_s: float = 30.0, compute_stream=None):
        super().__init__()
        self.device = torch.device(device)
        self.compute_stream = compute_stream  # CUDA: the engine's stream, which transfers order against
        choose_transport(self.device.type, None, None)  # refuses a device type no backend serves
        self.host, self.timeout_s = host, timeout_s
        self.device_id = device_id(self.device)
        self._backends: dict[TransportKind, Transport] = {}
        self._kinds: dict[str, TransportKind] = {}

    def _backend(self, kind: TransportKind) -> Transport:
        with self._lock:
            if kind not in self._backends:
                self._backends[kind] = {TransportKind.GLOO: lambda: GlooTransport(self.host, self.timeout_s),
                                        TransportKind.NCCL: lambda: NcclTransport(self.device, self.timeout_s,
                                                                                self.compute_stream),
                                        TransportKind.STAGED: lambda: StagedTransport(self.host, self.device,
                                                                                      self.timeout_s,
                                                                                      self.compute_stream)}[kind]()
            return self._backends[kind]

    def _local(self, wire: str) -> TransportKind:
        if wire == "nccl":
            return TransportKind.NCCL
        return TransportKind.GLOO if self.device.type == "cpu" else TransportKind.STAGED

    def kind_of(self, peer: str) -> TransportKind | None:
        """The backend of the channel to `peer` (None: none opened yet)."""
        with self._lock:
            return self._kinds.get(peer)

    def listen(self, peer: str, peer_device: str | None = None) -> PairAddress:
        """Host a new channel to `peer`, whose cache is on device `peer_device` (`device_id`; None: a
        CPU); returns the address it must `connect` to."""
        kind = choose_transport(self.device.type, self.device_id, peer_device)
        backend = self._backend(kind)
        address = backend.listen(peer)
        self._opened(peer, kind, backend)
        return PairAddress(kind.wire, address)

    def connect(self, peer: str, address: PairAddress) -> None:
        """Join the channel `peer` hosts at `address`, over the wire it chose."""
        kind = self._local(address.wire)
        backend = self._backend(kind)
        backend.connect(peer, address.address)
        self._opened(peer, kind, backend)

    def _opened(self, peer: str, kind: TransportKind, backend: Transport) -> None:
        self._add(backend.channel(peer))
        with self._lock:
            self._kinds[peer] = kind

    def drop(self, peer: str, channel: Any = None) -> None:
        """Close the channel to `peer` (only if it is still `channel`, when given), here and in its
        backend, which would otherwise keep it (and a gloo channel's listening store) alive."""
        super().drop(peer, channel)
        with self._lock:
            backend = self._backends.get(self._kinds.get(peer))
        if backend is not None:
            backend.drop(peer, channel)
        with self._lock:
            if not self._channels.get(peer):
                self._kinds.pop(peer, None)

    def close(self) -> None:
        super().close()
        with self._lock:
            backends = list(self._backends.values())
        for b in backends:
            b.close()


def make_transport(device: torch.device | str, host: str, timeout_s: float = 30.0,
                   compute_stream=None) -> DeviceTransport:
    """The transport of a KV cache on `device` (`DeviceTransport`: gloo on CPU; NCCL, or staged gloo
    for a peer on the same GPU, on CUDA). `compute_stream`: the engine's CUDA stream (its runner's
    `compute_stream`); transfers are ordered against it explicitly, not against whatever stream is
    current in the thread that posts them."""
    return DeviceTransport(device, host, timeout_s, compute_stream)
