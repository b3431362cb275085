"""GPU transport: a 2-rank `cupy.cuda.nccl.NcclCommunicator` per peer.

UNVERIFIED: written without a GPU; its tests (tests/kv_transfer/test_nccl.py) are marked `gpu` and
have not run yet. cupy is imported lazily so CPU-only installs never need it.

Same rendezvous shape as gloo (kv_transfer.gloo), so the Ray glue is one code path:

    exporter (rank 0)                           importer (rank 1)
    listen(peer) -> NcclAddress(unique id) -->  connect(peer, address)
      NcclCommunicator(2, id, 0)                  NcclCommunicator(2, id, 1)
      (in a thread: it blocks until the peer joins)     (waits at most timeout_s)

NCCL has no timeouts of its own: `wait` polls a CUDA event until the deadline, then aborts the
communicator (which fails every operation still queued on it), and the protocol treats the channel as
broken. Sends and receives run on torch's current stream of the tensor's device, so they are ordered
after the packing kernels that fill the buffer and before the unpacking kernels that read it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from kv_transfer.errors import PeerDiedError, TransferTimeoutError
from kv_transfer.transport import Channel, Pending, Transport


def _nccl():
    from cupy.cuda import nccl  # lazy: only GPU installs have cupy

    return nccl


@dataclass(frozen=True, slots=True)
class NcclAddress:
    """What rank 0 hands rank 1 (through a Ray call) to form their communicator."""

    unique_id: tuple


class _NcclPending:
    def __init__(self, channel: NcclChannel, event: torch.cuda.Event):
        self.channel, self.event = channel, event

    def wait(self, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        while not self.event.query():
            if self.channel.broken:
                raise PeerDiedError(f"nccl channel to {self.channel.peer!r} was closed")
            if time.monotonic() > end:
                self.channel.close()
                raise TransferTimeoutError(f"nccl transfer with {self.channel.peer!r} took over {timeout_s:.1f}s")
            time.sleep(0.0002)


class NcclChannel(Channel):
    serial = True  # one stream: a posted receive blocks the sends queued after it

    def __init__(self, peer: str, rank: int, device: torch.device, timeout_s: float):
        super().__init__(peer)
        self.rank, self.device, self.timeout_s = rank, device, timeout_s
        self.comm = None
        self._ready = threading.Event()
        self._error: Exception | None = None

    def _init(self, unique_id: tuple) -> None:
        """Form the communicator; blocks until the other rank does the same."""
        try:
            import cupy

            with torch.cuda.device(self.device), cupy.cuda.Device(self.device.index or 0):
                comm = _nccl().NcclCommunicator(2, unique_id, self.rank)
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

    def _op(self, tensor: torch.Tensor, send: bool) -> Pending:
        assert tensor.is_cuda and tensor.is_contiguous(), "nccl moves contiguous GPU tensors only"
        comm = self._communicator()
        nccl = _nccl()
        stream = torch.cuda.current_stream(tensor.device)
        try:
            fn = comm.send if send else comm.recv
            fn(tensor.data_ptr(), tensor.numel() * tensor.element_size(), nccl.NCCL_UINT8, 1 - self.rank,
               stream.cuda_stream)
        except Exception as e:
            self.close()
            raise PeerDiedError(f"nccl {'send to' if send else 'recv from'} {self.peer!r}: {e}") from e
        event = torch.cuda.Event()
        event.record(stream)
        return _NcclPending(self, event)

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

    def __init__(self, device: torch.device | str = "cuda", timeout_s: float = 30.0):
        super().__init__()
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"NcclTransport needs a CUDA device, got {device}")
        self.device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
        self.timeout_s = timeout_s

    def listen(self, peer: str) -> NcclAddress:
        """Host a new channel to `peer`; returns the address it must `connect` to. The communicator
        forms in the background once the peer joins. Replaces any existing channel to `peer`."""
        address = NcclAddress(tuple(_nccl().get_unique_id()))
        ch = NcclChannel(peer, 0, self.device, self.timeout_s)
        threading.Thread(target=ch._init, args=(address.unique_id,), daemon=True, name=f"nccl-listen-{peer}").start()
        self._add(ch)
        return address

    def connect(self, peer: str, address: NcclAddress) -> None:
        """Join the channel `peer` hosts as rank 1; waits at most `timeout_s` for it to form."""
        ch = NcclChannel(peer, 1, self.device, self.timeout_s)
        threading.Thread(target=ch._init, args=(address.unique_id,), daemon=True, name=f"nccl-join-{peer}").start()
        ch._communicator()
        self._add(ch)
