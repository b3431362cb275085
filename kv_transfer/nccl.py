"""GPU transport: a 2-rank `cupy.cuda.nccl.NcclCommunicator` per peer, on a CUDA stream of its own.

cupy is imported lazily so CPU-only installs never need it. Same rendezvous shape as gloo
(kv_transfer.gloo), so the Ray glue is one code path:

    exporter (rank 0)                           importer (rank 1)
    listen(peer) -> NcclAddress(unique id) -->  connect(peer, address)
      NcclCommunicator(2, id, 0)                  NcclCommunicator(2, id, 1)
      (in a thread: it blocks until the peer joins)     (waits at most timeout_s)

Streams: each channel sends and receives on its own stream, never on the engine's compute stream,
so a posted receive (which sits on its stream until the peer sends) does not hold back decoding, and
a dead peer blocks only the channel. Ordering against the compute stream is by events:

    compute stream  ..pack / KV written..[ready]......................[wait done]..unpack / read..
    channel stream                          [wait ready] send/recv [done]

the channel's stream waits on `ready` (recorded on the caller's current stream when the operation is
posted) before it reads or overwrites a GPU tensor, and the caller's stream waits on `done` once
`wait` has seen the operation finish. Small host tensors (headers, acks) travel through pinned
memory with non-blocking copies on the channel's stream: no synchronizing copy in either direction.

NCCL has no timeouts of its own: `wait` polls the `done` event until the deadline, then aborts the
communicator (which fails every operation still queued on it), and the protocol treats the channel
as broken. NCCL cannot pair two ranks on one device: a pair needs two GPUs.

What listens: `get_unique_id` starts NCCL's bootstrap root, a socket on the interface NCCL picks
(the first one up, loopback and docker ones excluded, unless NCCL_SOCKET_IFNAME says), and the
communicator's own bootstrap and proxy sockets on the same interface. `pin_interface(node ip)` makes
that the interface carrying the node's cluster address (NCCL_SOCKET_IFNAME, unless the operator set
it). The root's socket lives until both ranks joined, the others until `close` aborts the
communicator. A peer that never joins leaves the root (and rank 0's init thread) waiting: NCCL's
blocking init cannot be aborted; the router's `kv_forget_peer` cannot reach it either.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass

import torch

from kv_transfer.errors import PeerDiedError, TransferTimeoutError
from kv_transfer.transport import Channel, Pending, Transport


logger = logging.getLogger(__name__)
_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def interface_of(address: str) -> str | None:
    """The name of this host's network interface that holds IPv4 `address` (None: no such one)."""
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:  # down, or no IPv4 address
                continue
        if socket.inet_ntoa(raw[20:24]) == address:
            return name
    return None


def pin_interface(address: str) -> str | None:
    """Make NCCL's sockets (the unique-id root, bootstrap, proxy) listen on the interface holding the
    node's cluster `address` only: NCCL_SOCKET_IFNAME="=<name>" (exact match), unless the operator
    set it already. Call before the process's first NCCL call. Returns the value in force."""
    if "NCCL_SOCKET_IFNAME" not in os.environ:
        name = interface_of(address)
        if name is not None:
            os.environ["NCCL_SOCKET_IFNAME"] = f"={name}"
        else:
            logger.warning("no interface holds %s; NCCL picks its own (set NCCL_SOCKET_IFNAME)", address)
    return os.environ.get("NCCL_SOCKET_IFNAME")


def _nccl():
    from cupy.cuda import nccl  # lazy: only GPU installs have cupy

    return nccl


@dataclass(frozen=True, slots=True)
class NcclAddress:
    """What rank 0 hands rank 1 (through a Ray call) to form their communicator."""

    unique_id: bytes | tuple  # as `get_unique_id` returns it: bytes in cupy 14 (which refuses a tuple)


class _NcclPending:
    """One posted operation; `wait` polls its `done` event, then orders the caller's stream after it."""

    def __init__(self, channel: NcclChannel, done: torch.cuda.Event, host_out: torch.Tensor | None = None,
                 pinned: torch.Tensor | None = None):
        self.channel, self.done = channel, done
        self.host_out, self.pinned = host_out, pinned  # a received host tensor: copied out of `pinned`

    def wait(self, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        while not self.done.query():
            if self.channel.broken:
                raise PeerDiedError(f"nccl channel to {self.channel.peer!r} was closed")
            if time.monotonic() > end:
                self.channel.close()
                raise TransferTimeoutError(f"nccl transfer with {self.channel.peer!r} took over {timeout_s:.1f}s")
            time.sleep(0.0002)
        self.channel.caller_stream().wait_event(self.done)
        if self.host_out is not None and self.pinned is not self.host_out:
            self.host_out.copy_(self.pinned)


class NcclChannel(Channel):
    """Rank `rank` of a `world_size`-rank communicator (2: a prefill/decode pair; 1: the rank talks to
    itself, which only tests do, posting each send and its receive inside one NCCL group)."""

    serial = True  # one stream: a posted receive blocks the sends queued after it

    def __init__(self, peer: str, rank: int, device: torch.device, timeout_s: float, world_size: int = 2,
                 compute_stream: torch.cuda.Stream | None = None):
        super().__init__(peer)
        self.rank, self.device, self.timeout_s, self.world_size = rank, device, timeout_s, world_size
        self.compute_stream = compute_stream
        self.peer_rank = (rank + 1) % world_size
        self.stream = torch.cuda.Stream(device)
        self.comm = None
        self._ready = threading.Event()
        self._error: Exception | None = None

    def _init(self, unique_id: bytes | tuple) -> None:
        """Form the communicator; blocks until the other rank does the same."""
        try:
            import cupy

            with torch.cuda.device(self.device), cupy.cuda.Device(self.device.index or 0):
                comm = _nccl().NcclCommunicator(self.world_size, unique_id, self.rank)
            if self.broken:  # closed while we waited for the peer
                comm.abort()
            else:
                self.comm = comm
        except Exception as e:  # noqa: BLE001 - reported to whoever uses the channel
            self._error = e
            self.broken = True
        finally:
            self._ready.set()

    def _communicator(self):
        if not self._ready.wait(self.timeout_s):
            self.close()
            raise TransferTimeoutError(f"peer {self.peer!r} did not join the nccl channel in {self.timeout_s:.1f}s")
        if self.comm is None:
            raise PeerDiedError(f"nccl channel to {self.peer!r}: {self._error or 'closed'!r}")
        return self.comm

    def caller_stream(self) -> torch.cuda.Stream:
        """The stream the engine computes on (given explicitly: the engine may not run on the current
        stream of the thread that posts a transfer); the current one when none was given."""
        return self.compute_stream or torch.cuda.current_stream(self.device)

    def _stage(self, tensor: torch.Tensor, send: bool,
               caller: torch.cuda.Stream) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The GPU tensor NCCL moves for `tensor`, and the pinned host buffer of a host tensor. Runs
        with the channel's stream current: its copies and allocations belong to that stream."""
        if tensor.is_cuda:
            assert tensor.is_contiguous(), "nccl moves contiguous tensors only"
            # NOTE: the caller's (compute) stream last wrote this memory (packed blocks, the KV of a
            # prefill) or still reads it (blocks a receive overwrites): wait for the work queued there
            # so far, and only that; and keep the allocator from reusing the memory before this
            # stream is done with it.
            ready = torch.cuda.Event()
            ready.record(caller)
            self.stream.wait_event(ready)
            tensor.record_stream(self.stream)
            return tensor, None
        pinned = tensor if tensor.is_pinned() else torch.empty_like(tensor, pin_memory=True)
        if not send:
            return torch.empty(tensor.shape, dtype=tensor.dtype, device=self.device), pinned
        if pinned is not tensor:
            pinned.copy_(tensor)
        return pinned.to(self.device, non_blocking=True), pinned

    def _op(self, tensor: torch.Tensor, send: bool) -> Pending:
        comm = self._communicator()
        nccl = _nccl()
        caller = self.caller_stream()
        with torch.cuda.stream(self.stream):
            buf, pinned = self._stage(tensor, send, caller)
            try:
                fn = comm.send if send else comm.recv
                fn(buf.data_ptr(), buf.numel() * buf.element_size(), nccl.NCCL_UINT8, self.peer_rank,
                   self.stream.cuda_stream)
            except Exception as e:
                self.close()
                raise PeerDiedError(f"nccl {'send to' if send else 'recv from'} {self.peer!r}: {e}") from e
            if pinned is not None and not send:  # a host tensor's receive lands in pinned memory first
                pinned.copy_(buf, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        return _NcclPending(self, done, tensor if pinned is not None and not send else None, pinned)

    def isend(self, tensor: torch.Tensor, tag: int = 0) -> Pending:
        return self._op(tensor, True)  # one stream: NCCL matches in order, no tags

    def irecv(self, tensor: torch.Tensor, tag: int = 0) -> Pending:
        return self._op(tensor, False)

    def close(self) -> None:
        super().close()
        comm, self.comm = self.comm, None
        if comm is not None:
            try:
                comm.abort()
            except Exception:  # noqa: BLE001 - already torn down
                pass


class NcclTransport(Transport):
    """NCCL channels on one CUDA device. Rank 0 (the exporter) `listen`s, rank 1 `connect`s."""

    def __init__(self, device: torch.device | str = "cuda", timeout_s: float = 30.0,
                 compute_stream: torch.cuda.Stream | None = None):
        """`compute_stream`: the stream the engine's forward passes run on (transfers are ordered
        against it by events); None: the posting thread's current stream."""
        super().__init__()
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"NcclTransport needs a CUDA device, got {device}")
        self.device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
        self.timeout_s = timeout_s
        self.compute_stream = compute_stream

    def listen(self, peer: str) -> NcclAddress:
        """Host a new channel to `peer`; returns the address it must `connect` to. The communicator
        forms in the background once the peer joins. Replaces any existing channel to `peer`."""
        address = NcclAddress(_nccl().get_unique_id())
        ch = NcclChannel(peer, 0, self.device, self.timeout_s, compute_stream=self.compute_stream)
        threading.Thread(target=ch._init, args=(address.unique_id,), daemon=True, name=f"nccl-listen-{peer}").start()
        self._add(ch)
        return address

    def connect(self, peer: str, address: NcclAddress) -> None:
        """Join the channel `peer` hosts as rank 1; waits at most `timeout_s` for it to form."""
        ch = NcclChannel(peer, 1, self.device, self.timeout_s, compute_stream=self.compute_stream)
        threading.Thread(target=ch._init, args=(address.unique_id,), daemon=True, name=f"nccl-join-{peer}").start()
        ch._communicator()
        self._add(ch)
