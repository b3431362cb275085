"""One request's KV over one channel: header, its blocks in a few chunks, acknowledgement.

    sender (prefill, holds the lease)             receiver (decode)
                                                  allocate blocks (fail: ReceiverOutOfBlocksError)
                                                  lock channel, ask the sender to push,
                                                  post the header's and every chunk's receive
    lock channel, pin lease (fail: error header,
      then filler chunks), post the ack's receive
    header [magic,status,req,epoch,nblk,ntok,nmsg,chk] ->  check it against the handle
    chunk (blocks 0..k-1) ----------------------->  recv into the cache, or into staging
    chunk (blocks k..2k-1) ---------------------->    then scattered a chunk at a time
    ...  (~8 MiB each)                              ...
    wait ack <-------------------------------------- ack header [.., OK, req, epoch, ..]
    lease.ack -> free blocks                        blocks belong to the decode engine now

The cache is block-major (engine.model_runner), so a side whose block ids are one run of consecutive
ids sends from (or receives into) its cache with no copy at all; otherwise it packs (or stages) a
chunk at a time, overlapping the copy with the wire. Each side decides alone: the messages are the
same either way. Few, large messages matter: each gloo send or receive costs ~50 us of Python and
wake-ups on each side, and a layer-major cache needed 2 x layers of them (60 for SmolLM2).

Every receive is posted before the first wait, on both sides: gloo moves a message only once its
receive is posted, so a receive posted late (after the header was read, or the ack's after the last
chunk) idles the wire for a wake-up and a round trip. A refusal therefore still sends every chunk
(one reused buffer of filler, never read) so the receiver's posted receives complete and the stream
stays in step; refusals are rare (a lease that ran out or was superseded).

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
from kv_transfer.packing import block_chunks, pack_blocks, unpack_blocks
from kv_transfer.transport import Channel

MAGIC = 0x4B565846_0003  # "KVXF", protocol version 3 (block-major chunks)
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


def chunks_for(handle: KVHandle, group_bytes: int = 8 << 20) -> list[slice]:
    """The block ranges that go as one message each (the same on both sides)."""
    return block_chunks(handle.layout, handle.num_blocks, group_bytes)


def _tag(i: int) -> int:
    # Each chunk has its own tag (header and ack use 0): gloo may pair outstanding sends and receives
    # of one tag out of order, which for equal-sized chunks would go unnoticed.
    return 1 + i


def send_status(channel: Channel, handle: KVHandle, status: Status, timeout_s: float,
                device: torch.device | str = "cpu", group_bytes: int = 8 << 20) -> None:
    """Tell the receiver this transfer will not happen: the refusal header, then filler for every
    chunk it has posted a receive for (no ack follows)."""
    deadline = _Deadline(timeout_s)
    chunks = chunks_for(handle, group_bytes)
    longest = max(c.stop - c.start for c in chunks)
    filler = torch.zeros(handle.layout.packed_shape(longest), dtype=handle.layout.torch_dtype, device=device)
    sends = [channel.isend(encode_header(status, handle, 0, device))]
    sends += [channel.isend(filler[:c.stop - c.start], _tag(i)) for i, c in enumerate(chunks)]
    for s in sends:
        s.wait(deadline.left())


def _run_start(block_ids) -> int | None:
    """The first id if `block_ids` are consecutive (b, b+1, ...), else None."""
    b0 = block_ids[0]
    return b0 if all(b == b0 + i for i, b in enumerate(block_ids)) else None


def send_kv(channel: Channel, kv_cache: torch.Tensor, handle: KVHandle, timeout_s: float,
            group_bytes: int = 8 << 20) -> None:
    """Send `handle`'s blocks from `kv_cache` and wait for the receiver's acknowledgement.

    The caller holds `channel.lock` and has validated (and pinned) the lease.
    """
    deadline = _Deadline(timeout_s)
    chunks = chunks_for(handle, group_bytes)
    ack = torch.empty(HEADER_LEN, dtype=torch.int64, device=kv_cache.device)
    # Posted first (where that cannot hold the sends back): the receiver's ack then goes out at once.
    ack_recv = None if channel.serial else channel.irecv(ack)
    sends = [channel.isend(encode_header(Status.OK, handle, len(chunks), kv_cache.device))]
    b0 = _run_start(handle.block_ids)
    if b0 is not None:  # zero copy: the chunks are slices of the cache
        run = kv_cache[b0:b0 + handle.num_blocks]
        sends += [channel.isend(run[c], _tag(i)) for i, c in enumerate(chunks)]
    else:
        buf = _staging(channel, handle, kv_cache.device)
        for i, c in enumerate(chunks):
            pack_blocks(kv_cache, handle.block_ids, out=buf, blocks=c)
            # NOTE: gloo sends run on its own threads, so packing the next chunk overlaps this one.
            sends.append(channel.isend(buf[c], _tag(i)))
    for s in sends:
        s.wait(deadline.left())
    (ack_recv or channel.irecv(ack)).wait(deadline.left())
    hdr = decode_header(ack)
    if (hdr.request_hash, hdr.epoch) != (request_hash(handle.request_id), handle.epoch):
        raise ProtocolError(f"ack for another transfer (epoch {hdr.epoch}) while sending {handle.request_id!r}")
    if hdr.status is not Status.OK:
        raise KVTransferError(f"receiver rejected {handle.request_id!r}: {hdr.status.name}")


class PostedRecv(NamedTuple):
    """The receives of one transfer, posted before the sender was asked to push (`post_recv_kv`)."""

    header: torch.Tensor
    header_recv: object
    chunks: list[slice]
    chunk_recvs: list
    staging: torch.Tensor | None  # None: straight into the cache (this side's blocks are one run)


def post_recv_kv(channel: Channel, kv_cache: torch.Tensor, handle: KVHandle, block_ids: list[int],
                 group_bytes: int = 8 << 20) -> PostedRecv:
    """Post the header's and every chunk's receive for `handle` into this side's `block_ids`."""
    assert len(block_ids) == handle.num_blocks, (len(block_ids), handle.num_blocks)
    raw = torch.empty(HEADER_LEN, dtype=torch.int64, device=kv_cache.device)
    header_recv = channel.irecv(raw)
    chunks = chunks_for(handle, group_bytes)
    b0 = _run_start(block_ids)
    # zero copy: receive straight into the (fresh, unused) blocks; else into staging, then scatter
    buf = None if b0 is not None else _staging(channel, handle, kv_cache.device)
    dst = kv_cache[b0:b0 + len(block_ids)] if buf is None else buf
    recvs = [channel.irecv(dst[c], _tag(i)) for i, c in enumerate(chunks)]
    return PostedRecv(raw, header_recv, chunks, recvs, buf)


def recv_kv(channel: Channel, kv_cache: torch.Tensor, handle: KVHandle, block_ids: list[int],
            timeout_s: float, posted: PostedRecv | None = None, group_bytes: int = 8 << 20) -> None:
    """Receive `handle`'s blocks into `kv_cache` at this side's `block_ids`, then acknowledge.

    The caller holds `channel.lock`, allocated `block_ids`, has asked the sender to push and, best
    right after that, posted the receives (`post_recv_kv`; posted here if not).
    Raises `LeaseExpiredError` / `EpochMismatchError` if the sender refused (stream still in step),
    `ProtocolError` if the header does not describe this transfer.
    """
    deadline = _Deadline(timeout_s)
    posted = posted or post_recv_kv(channel, kv_cache, handle, block_ids, group_bytes)
    posted.header_recv.wait(deadline.left())
    hdr = decode_header(posted.header)
    if hdr.request_hash != request_hash(handle.request_id):
        raise ProtocolError(f"expected KV of {handle.request_id!r}, got another request's (hash {hdr.request_hash})")
    if hdr.status in (Status.LEASE_EXPIRED, Status.EPOCH_MISMATCH):
        for r in posted.chunk_recvs:  # the sender's filler: drained so the stream stays in step
            r.wait(deadline.left())
        if hdr.status is Status.LEASE_EXPIRED:
            raise LeaseExpiredError(f"{handle.worker_id}: lease on {handle.request_id!r} is gone; re-prefill it")
        raise EpochMismatchError(f"{handle.worker_id}: epoch {handle.epoch} of {handle.request_id!r} "
                                 "was superseded; re-prefill it")
    got = (hdr.status, hdr.epoch, hdr.num_blocks, hdr.num_tokens, hdr.num_messages)
    want = (Status.OK, handle.epoch, handle.num_blocks, handle.num_tokens, len(posted.chunks))
    if got != want:
        # NOTE: never use blocks sent under another epoch: that data may belong to a superseded grant.
        raise ProtocolError(f"header {got} does not match the handle {want} of {handle.request_id!r}")
    for c, r in zip(posted.chunks, posted.chunk_recvs):
        r.wait(deadline.left())
        if posted.staging is not None:
            unpack_blocks(kv_cache, block_ids, posted.staging, blocks=c)  # overlaps the next chunk's receive
    channel.isend(encode_header(Status.OK, handle, len(posted.chunks), kv_cache.device)).wait(deadline.left())
