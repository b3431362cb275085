"""Both ends of a transfer without any Ray: `KVSender` (prefill side) and `KVReceiver` (decode side).

The Ray glue (deployments/cluster/kv_endpoint.py) only adds channel set-up and the "please push" call.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import torch

from kv_transfer.errors import (EpochMismatchError, KVTransferError, LeaseExpiredError,
                                ReceiverOutOfBlocksError)
from kv_transfer.handle import KVHandle, KVLayout
from kv_transfer.lease import LeaseTable
from kv_transfer.protocol import Status, post_recv_kv, recv_kv, send_kv, send_status
from kv_transfer.transport import Transport

logger = logging.getLogger(__name__)


class KVSender:
    """Pushes leased blocks to peers. Every push ends the lease: blocks are freed on the receiver's
    ack and on any failure (the request is then re-prefilled), except when the handle is stale
    (`EpochMismatchError`): the newer grant keeps them."""

    def __init__(self, transport: Transport, kv_cache: torch.Tensor, leases: LeaseTable, timeout_s: float = 30.0,
                 gather: Callable[[list[int]], torch.Tensor] | None = None):
        """`gather(block_ids)`: the blocks' KV in `leases.layout` (every KV head), where `kv_cache` holds
        only part of it (rank 0 of a tensor-parallel worker: engine.parallel.kv_shards); None: the
        blocks are sent straight from `kv_cache`, whose layout is the lease table's."""
        assert gather is not None or leases.layout == KVLayout.of(kv_cache)
        self.transport, self.kv_cache, self.leases, self.timeout_s = transport, kv_cache, leases, timeout_s
        self.gather = gather
        self.num_sent = 0
        self.num_failed = 0
        self.bytes_sent = 0

    def push(self, handle: KVHandle, peer: str, timeout_s: float | None = None) -> None:
        """Send `handle`'s blocks to `peer` (who is waiting in `KVReceiver.receive`); return after its ack."""
        timeout_s = timeout_s or self.timeout_s
        rid = handle.request_id
        try:
            channel = self.transport.channel(peer)
        except KVTransferError:
            self.num_failed += 1
            self.leases.release(rid, handle.epoch)
            raise
        with channel.lock:
            try:
                live = self.leases.begin_transfer(rid, handle.epoch)
            except (LeaseExpiredError, EpochMismatchError) as e:
                self.num_failed += 1
                if isinstance(e, LeaseExpiredError):
                    self.leases.release(rid, handle.epoch)
                status = Status.LEASE_EXPIRED if isinstance(e, LeaseExpiredError) else Status.EPOCH_MISMATCH
                try:
                    send_status(channel, handle, status, timeout_s, self.kv_cache.device)
                except KVTransferError:
                    self.transport.drop(peer, channel)
                raise
            try:
                if self.gather is None:
                    send_kv(channel, self.kv_cache, live, timeout_s)
                else:  # the gathered blocks are one run 0..n-1 of their own tensor: sent with no copy
                    full = self.gather(list(live.block_ids))
                    send_kv(channel, full, dataclasses.replace(live, block_ids=tuple(range(live.num_blocks))),
                            timeout_s)
            except BaseException:
                self.num_failed += 1
                self.transport.drop(peer, channel)
                self.leases.end_transfer(rid)
                self.leases.release(rid, handle.epoch)
                raise
            self.leases.end_transfer(rid)
        self.leases.ack(rid, handle.epoch)
        self.num_sent += 1
        self.bytes_sent += live.nbytes


class KVReceiver:
    """Receives a handle's blocks into freshly allocated blocks of this side's cache.

    `allocate(num_tokens) -> block ids | None` and `free(block_ids)` are the engine's (wrapped in its
    lock if it steps on another thread).
    """

    def __init__(self, transport: Transport, kv_cache: torch.Tensor,
                 allocate: Callable[[int], list[int] | None], free: Callable[[list[int]], object],
                 timeout_s: float = 30.0, layout: KVLayout | None = None,
                 scatter: Callable[[list[int], torch.Tensor], object] | None = None):
        """`layout` and `scatter(block_ids, blocks)`: where `kv_cache` holds only part of each block
        (rank 0 of a tensor-parallel worker), the full `layout` travels and `scatter` writes received
        blocks into every rank's cache; None: blocks land straight in `kv_cache`."""
        self.transport, self.kv_cache, self.timeout_s = transport, kv_cache, timeout_s
        assert (layout is None) == (scatter is None)
        self.layout = layout or KVLayout.of(kv_cache)
        self.scatter = scatter
        self._allocate, self._free = allocate, free
        self.num_received = 0
        self.num_failed = 0
        self.bytes_received = 0

    def receive(self, handle: KVHandle, start_push: Callable[[], object],
                abandon: Callable[[], object] = lambda: None, timeout_s: float | None = None) -> list[int]:
        """Allocate, call `start_push()` (the sender must then `push` to us concurrently), receive,
        acknowledge. Returns this side's block ids, now holding the KV of `handle.num_tokens` tokens.

        On failure frees the blocks and raises a `KVTransferError`; if it fails before `start_push`
        it calls `abandon()` so the sender can free its side at once.
        """
        timeout_s = timeout_s or self.timeout_s
        started = False
        block_ids: list[int] | None = None
        try:
            if handle.layout != self.layout:
                raise KVTransferError(f"{handle.request_id!r}: sender layout {handle.layout} != ours {self.layout}; "
                                      "prefill and decode must run the same model and dtype")
            # NOTE: no check of handle.expires_at here: it is the sender's wall clock, and another host's
            # clock may run ahead by more than a lease. The sender judges its lease on its own clock and
            # answers an expired one with a status header (LeaseExpiredError below).
            block_ids = self._allocate(handle.num_tokens)
            if block_ids is None:
                raise ReceiverOutOfBlocksError(f"{handle.num_blocks} KV blocks needed for {handle.request_id!r}; "
                                               "route it to a less loaded decode worker")
            channel = self.transport.channel(handle.worker_id)
            with channel.lock:
                started = True
                start_push()
                # With `scatter`: into a full-layout buffer (ids 0..n-1: no copy), then to the ranks.
                dst, dst_ids = self.kv_cache, block_ids
                if self.scatter is not None:
                    dst = torch.empty(self.layout.packed_shape(handle.num_blocks), dtype=self.layout.torch_dtype,
                                      device=self.kv_cache.device)
                    dst_ids = list(range(handle.num_blocks))
                try:
                    # posted while the push request travels: no message waits for its receive
                    posted = post_recv_kv(channel, dst, handle, dst_ids)
                    recv_kv(channel, dst, handle, dst_ids, timeout_s, posted)
                except (LeaseExpiredError, EpochMismatchError):
                    raise  # refused by a status header: the stream is still in step
                except BaseException:
                    self.transport.drop(handle.worker_id, channel)
                    raise
            if self.scatter is not None:
                self.scatter(block_ids, dst)
        except BaseException:
            self.num_failed += 1
            if block_ids is not None:
                self._free(block_ids)
            if not started:
                try:
                    abandon()
                except Exception:
                    logger.warning("could not tell %s to drop %s", handle.worker_id, handle.request_id, exc_info=True)
            raise
        self.num_received += 1
        self.bytes_received += handle.nbytes
        return block_ids
