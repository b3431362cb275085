"""One request's KV over one channel: header, one message per (layer, K/V) plane, acknowledgement.

    sender (prefill, holds the lease)             receiver (decode)
                                                  allocate blocks (fail: ReceiverOutOfBlocksError)
                                                  lock channel, ask the sender to push
    lock channel, pin lease (fail: error header)
    header [magic,status,req,epoch,nblk,ntok,nmsg,chk] ->  check it against the handle
    plane (layer 0, K) -------------------------->  recv into the cache, or into staging
    plane (layer 0, V) -------------------------->    then scattered a layer group at a time
    ...  (2 x layers messages)                      ...
    wait ack <-------------------------------------- ack header [.., OK, req, epoch, ..]
    lease.ack -> free blocks                        blocks belong to the decode engine now

A plane is `cache[layer, k|v, blocks]`: contiguous in the cache itself when a side's block ids are
one run of consecutive ids. Then that side sends from (or receives into) its cache with no copy at
all; otherwise it packs (or stages) a layer group at a time, overlapping the copy with the wire.
Each side decides alone: the messages are the same either way.

Any failure raises a typed error (kv_transfer.errors); the caller frees its side's blocks and drops
the channel unless the error came cleanly from a status header (the stream is then still in step).
"""

from __future__ import annotations

import hashlib
import time
from enum import IntEnum
from typing import NamedTuple

import torch

from kv_transfer.errors import (EpochMismatchError, KVTransferError, LeaseExpiredError, ProtocolError,
                                TransferTimeoutError)
from kv_transfer.handle import KVHandle
from kv_transfer.packing import layer_groups, pack_blocks, unpack_blocks
from kv_transfer.transport import Channel

MAGIC = 0x4B565846_0002  # "KVXF", protocol version 2 (one message per plane)
HEADER_LEN = 8
_MASK = (1 << 64) - 1


class Status(IntEnum):
    OK = 0
    LEASE_EXPIRED = 1
    EPOCH_MISMATCH = 2


class Header(NamedTuple):
    status: Status
    request_hash: int
    epoch: int
    num_blocks: int
    num_tokens: int
    num_messages: int


def _signed(x: int) -> int:
    x &= _MASK
    return x - (1 << 64) if x >= 1 << 63 else x


def request_hash(request_id: str) -> int:
    """A stable 64-bit id for a request (Python's `hash` is salted per process)."""
    return _signed(int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "little"))


def _checksum(fields) -> int:
    h = 0xCBF29CE484222325
    for f in fields:
        h = ((h ^ (f & _MASK)) * 0x100000001B3) & _MASK
    return _signed(h)


def encode_header(status: Status, handle: KVHandle, num_messages: int,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    fields = [MAGIC, int(status), request_hash(handle.request_id), handle.epoch, handle.num_blocks,
              handle.num_tokens, num_messages]
    # NOTE: on the cache's device: NCCL only moves GPU memory.
    return torch.tensor(fields + [_checksum(fields)], dtype=torch.int64, device=device)


def decode_header(t: torch.Tensor) -> Header:
    fields = t.tolist()
    if fields[0] != MAGIC or _checksum(fields[:-1]) != fields[-1]:
        raise ProtocolError(f"corrupted or foreign KV header {fields}")
    try:
        status = Status(fields[1])
    except ValueError:
        raise ProtocolError(f"unknown status {fields[1]} in KV header") from None
    return Header(status, *fields[2:7])


class _Deadline:
    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.end = time.monotonic() + timeout_s

    def left(self) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            raise TransferTimeoutError(f"KV transfer took longer than {self.timeout_s:.1f}s")
        return left


def _staging(channel: Channel, handle: KVHandle, device: torch.device) -> torch.Tensor:
    """The channel's reused packed buffer, grown as needed (fresh pages cost more than the copy)."""
    buf = getattr(channel, "staging", None)
    if buf is None or buf.numel() < handle.nbytes or buf.device != device:
        buf = torch.empty(handle.nbytes, dtype=torch.uint8, device=device)
        channel.staging = buf
    return buf[:handle.nbytes].view(handle.layout.torch_dtype).view(handle.layout.packed_shape(handle.num_blocks))


def send_status(channel: Channel, handle: KVHandle, status: Status, timeout_s: float,
                device: torch.device | str = "cpu") -> None:
    """Tell the receiver this transfer will not happen (no blocks, no ack follow)."""
    channel.isend(encode_header(status, handle, 0, device)).wait(timeout_s)


def _run_start(block_ids) -> int | None:
    """The first id if `block_ids` are consecutive (b, b+1, ...), else None."""
    b0 = block_ids[0]
    return b0 if all(b == b0 + i for i, b in enumerate(block_ids)) else None


def _planes(kv: torch.Tensor, first_layer: int = 0) -> list[tuple[int, torch.Tensor]]:
    """The wire messages of a [layers, 2, blocks, ...] tensor, (tag, plane) in order: (layer 0, K),
    (layer 0, V), ... Each plane has its own tag (header and ack use 0): gloo may pair outstanding
    sends and receives of one tag out of order, which for equal-sized planes would go unnoticed."""
    return [(1 + 2 * (first_layer + layer) + i, kv[layer, i]) for layer in range(kv.shape[0]) for i in range(2)]


def messages_for(handle: KVHandle) -> int:
    return 2 * handle.layout.num_layers


def send_kv(channel: Channel, kv_cache: torch.Tensor, handle: KVHandle, timeout_s: float,
            group_bytes: int = 8 << 20) -> None:
    """Send `handle`'s blocks from `kv_cache` and wait for the receiver's acknowledgement.

    The caller holds `channel.lock` and has validated (and pinned) the lease.
    """
    deadline = _Deadline(timeout_s)
    sends = [channel.isend(encode_header(Status.OK, handle, messages_for(handle), kv_cache.device))]
    b0 = _run_start(handle.block_ids)
    if b0 is not None:  # zero copy: the planes are slices of the cache
        sends += [channel.isend(p, tag) for tag, p in _planes(kv_cache[:, :, b0:b0 + handle.num_blocks])]
    else:
        buf = _staging(channel, handle, kv_cache.device)
        for g in layer_groups(handle.layout, handle.num_blocks, group_bytes):
            pack_blocks(kv_cache, handle.block_ids, out=buf, layers=g)
            # NOTE: gloo sends run on its own threads, so packing the next group overlaps these.
            sends += [channel.isend(p, tag) for tag, p in _planes(buf[g], g.start)]
    for s in sends:
        s.wait(deadline.left())
    ack = torch.empty(HEADER_LEN, dtype=torch.int64, device=kv_cache.device)
    channel.irecv(ack).wait(deadline.left())
    hdr = decode_header(ack)
    if (hdr.request_hash, hdr.epoch) != (request_hash(handle.request_id), handle.epoch):
        raise ProtocolError(f"ack for another transfer (epoch {hdr.epoch}) while sending {handle.request_id!r}")
    if hdr.status is not Status.OK:
        raise KVTransferError(f"receiver rejected {handle.request_id!r}: {hdr.status.name}")


def recv_kv(channel: Channel, kv_cache: torch.Tensor, handle: KVHandle, block_ids: list[int],
            timeout_s: float, group_bytes: int = 8 << 20) -> None:
    """Receive `handle`'s blocks into `kv_cache` at this side's `block_ids`, then acknowledge.

    The caller holds `channel.lock`, allocated `block_ids` and has asked the sender to push.
    Raises `LeaseExpiredError` / `EpochMismatchError` if the sender refused (stream still in step),
    `ProtocolError` if the header does not describe this transfer.
    """
    assert len(block_ids) == handle.num_blocks, (len(block_ids), handle.num_blocks)
    deadline = _Deadline(timeout_s)
    raw = torch.empty(HEADER_LEN, dtype=torch.int64, device=kv_cache.device)
    channel.irecv(raw).wait(deadline.left())
    hdr = decode_header(raw)
    if hdr.request_hash != request_hash(handle.request_id):
        raise ProtocolError(f"expected KV of {handle.request_id!r}, got another request's (hash {hdr.request_hash})")
    if hdr.status is Status.LEASE_EXPIRED:
        raise LeaseExpiredError(f"{handle.worker_id}: lease on {handle.request_id!r} is gone; re-prefill it")
    if hdr.status is Status.EPOCH_MISMATCH:
        raise EpochMismatchError(f"{handle.worker_id}: epoch {handle.epoch} of {handle.request_id!r} "
                                 "was superseded; re-prefill it")
    got = (hdr.status, hdr.epoch, hdr.num_blocks, hdr.num_tokens, hdr.num_messages)
    want = (Status.OK, handle.epoch, handle.num_blocks, handle.num_tokens, messages_for(handle))
    if got != want:
        # NOTE: never use blocks sent under another epoch: that data may belong to a superseded grant.
        raise ProtocolError(f"header {got} does not match the handle {want} of {handle.request_id!r}")
    b0 = _run_start(block_ids)
    if b0 is not None:  # zero copy: receive straight into the (fresh, unused) blocks
        for r in [channel.irecv(p, tag) for tag, p in _planes(kv_cache[:, :, b0:b0 + len(block_ids)])]:
            r.wait(deadline.left())
    else:
        buf = _staging(channel, handle, kv_cache.device)
        groups = layer_groups(handle.layout, handle.num_blocks, group_bytes)
        recvs = [[channel.irecv(p, tag) for tag, p in _planes(buf[g], g.start)] for g in groups]
        for g, rs in zip(groups, recvs):
            for r in rs:
                r.wait(deadline.left())
            unpack_blocks(kv_cache, block_ids, buf, layers=g)  # overlaps the next group's receive
    channel.isend(encode_header(Status.OK, handle, messages_for(handle), kv_cache.device)).wait(deadline.left())
