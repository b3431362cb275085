"""Gloo channels for a KV cache on a GPU, every device tensor staged through (pinned) host memory.

For a prefill/decode pair on ONE GPU (both pools on one device, `worker_num_gpus` < 1): NCCL cannot
pair two ranks on one device, so such a pair talks gloo (kv_transfer.gloo) like CPU workers do, and
each side copies between its device and host memory:

    sender (device tensor)                          receiver (device tensor)
    isend: device -> pinned host copy, waiting      irecv: gloo receive into a pinned host buffer
           for the work the caller's stream has     wait:  the receive done, the host -> device copy
           queued; then the gloo send of the copy          queued on the caller's stream, so every
                                                           later kernel there reads the data

The wire is plain gloo (same tags, sizes and order): the peer may be a `GlooTransport` of a CPU
worker. Tensors not on the staged device (host tensors) pass straight through. The staging copy runs
in the transfer's thread (the decode worker's pull, the prefill worker's push), never in the engine's
step loop; `kv_transfer.factory.DeviceTransport` chooses this transport for a pair on one device.
"""

from __future__ import annotations

import contextlib

import torch

from kv_transfer.gloo import GlooTransport
from kv_transfer.transport import Channel, Pending, Transport


def _on(stream):
    """The context that makes `stream` current (nothing when None: the current stream stays)."""
    return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)


class _StagedPending:
    """A gloo operation on a host copy; for a receive, `wait` then copies the host buffer into `out`."""

    def __init__(self, inner: Pending, host: torch.Tensor, out: torch.Tensor | None = None, stream=None):
        self.inner, self.host, self.out, self.stream = inner, host, out, stream

    def wait(self, timeout_s: float) -> None:
        self.inner.wait(timeout_s)
        if self.out is not None:
            # NOTE: from pinned memory the copy is queued on the compute stream (no host sync);
            # torch's pinned allocator keeps the buffer from reuse until the copy is done.
            with _on(self.stream):
                self.out.copy_(self.host, non_blocking=self.host.is_pinned())
            self.out = None
        self.host = None  # the send's copy (or the receive's buffer) can go


class StagedChannel(Channel):
    """A gloo channel (`inner`) whose tensors on `device` travel as host copies (pinned if `pin`)."""

    def __init__(self, inner: Channel, device: torch.device, pin: bool, compute_stream=None):
        self.inner = inner  # first: Channel.__init__ sets `broken`, which lives in `inner`
        super().__init__(inner.peer)
        self.device, self.pin, self.compute_stream = device, pin, compute_stream

    # The inner gloo channel marks itself broken on a failed operation; so does this one.
    @property
    def broken(self) -> bool:
        return self.inner.broken

    @broken.setter
    def broken(self, value: bool) -> None:
        self.inner.broken = self.inner.broken or value  # sticky: never revives a failed channel

    def _stages(self, tensor: torch.Tensor) -> bool:
        return tensor.device == self.device

    def _host_buffer(self, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(like.shape, dtype=like.dtype, pin_memory=self.pin)

    def isend(self, tensor: torch.Tensor, tag: int = 0) -> Pending:
        if not self._stages(tensor):
            return self.inner.isend(tensor, tag)
        host = self._host_buffer(tensor)
        # NOTE: a blocking copy on the compute stream: it waits for what the engine queued before it
        # (the packed blocks, the prefill's KV writes), and gloo may read the host copy once posted.
        with _on(self.compute_stream):
            host.copy_(tensor)
        return _StagedPending(self.inner.isend(host, tag), host)

    def irecv(self, tensor: torch.Tensor, tag: int = 0) -> Pending:
        if not self._stages(tensor):
            return self.inner.irecv(tensor, tag)
        host = self._host_buffer(tensor)
        return _StagedPending(self.inner.irecv(host, tag), host, tensor, self.compute_stream)

    def close(self) -> None:
        self.inner.close()


class StagedTransport(Transport):
    """Gloo channels (rendezvous as `GlooTransport`'s) carrying a `device` KV cache through host memory.

    `host` is this node's address as peers reach it. Pinned host buffers on CUDA; on CPU (tests) the
    tensors are still copied, so the staging logic runs without a GPU."""

    def __init__(self, host: str, device: torch.device | str, timeout_s: float = 30.0, compute_stream=None):
        """`compute_stream`: the CUDA stream the engine computes on (None: the current one)."""
        super().__init__()
        self.compute_stream = compute_stream
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.pin = self.device.type == "cuda"
        self._gloo = GlooTransport(host, timeout_s)

    def listen(self, peer: str) -> tuple[str, int]:
        """Host a new channel to `peer` (gloo rank 0); the (host, port) it must `connect` to."""
        address = self._gloo.listen(peer)
        self._add(StagedChannel(self._gloo.channel(peer), self.device, self.pin, self.compute_stream))
        return address

    def connect(self, peer: str, address: tuple[str, int]) -> None:
        """Join the channel `peer` hosts at `address` (gloo rank 1); blocks until it is formed."""
        self._gloo.connect(peer, address)
        self._add(StagedChannel(self._gloo.channel(peer), self.device, self.pin, self.compute_stream))

    def drop(self, peer: str, channel: Channel | None = None) -> None:
        """Close the channel to `peer` (only if it is still `channel`, when given), and let the inner
        gloo transport forget it too."""
        super().drop(peer, channel)
        self._gloo.drop(peer, channel.inner if isinstance(channel, StagedChannel) else None)

    def close(self) -> None:
        super().close()
        self._gloo.close()
