"""GPU transport: a 2-rank `cupy.cuda.nccl.NcclCommunicator` per peer.

UNVERIFIED: written without a GPU; its tests are marked `gpu`. cupy is imported lazily so CPU-only
installs never need it. The unique id comes from the rank-0 side (`new_unique_id`) and reaches the
other side through the caller (a Ray call), then both call `connect` at the same time.

NCCL has no timeouts of its own: `wait` polls a CUDA event until the deadline, then aborts the
communicator (which fails every operation still queued on it).
"""

from __future__ import annotations

import time

import torch

from kv_transfer.errors import PeerDiedError, TransferTimeoutError
from kv_transfer.transport import Channel, Pending, Transport


def _nccl():
    from cupy.cuda import nccl  # lazy: only GPU installs have cupy

    return nccl


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
    def __init__(self, peer: str, comm, rank: int):
        super().__init__(peer)
        self.comm, self.rank = comm, rank

    def _op(self, tensor: torch.Tensor, send: bool) -> Pending:
        assert tensor.is_cuda and tensor.is_contiguous()
        nccl = _nccl()
        # NOTE: torch's current stream, so the op is ordered after the packing kernels that fill it.
        stream = torch.cuda.current_stream(tensor.device).cuda_stream
        try:
            fn = self.comm.send if send else self.comm.recv
            fn(tensor.data_ptr(), tensor.numel() * tensor.element_size(), nccl.NCCL_UINT8, 1 - self.rank, stream)
        except Exception as e:
            self.broken = True
            raise PeerDiedError(f"nccl {'send to' if send else 'recv from'} {self.peer!r}: {e}") from e
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(tensor.device))
        return _NcclPending(self, event)

    def isend(self, tensor: torch.Tensor) -> Pending:
        return self._op(tensor, True)

    def irecv(self, tensor: torch.Tensor) -> Pending:
        return self._op(tensor, False)

    def close(self) -> None:
        super().close()
        comm, self.comm = self.comm, None
        if comm is not None:
            try:
                comm.abort()
            except Exception:
                pass


class NcclTransport(Transport):
    """NCCL channels. Rank 0 (the exporter) makes the id; both sides then `connect` concurrently."""

    @staticmethod
    def new_unique_id() -> tuple:
        return _nccl().get_unique_id()

    def connect(self, peer: str, unique_id: tuple, rank: int) -> None:
        """Blocks until the peer calls `connect` with the same id and the other rank."""
        comm = _nccl().NcclCommunicator(2, unique_id, rank)
        self._add(NcclChannel(peer, comm, rank))
