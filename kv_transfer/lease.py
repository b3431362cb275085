"""Sender-side leases: which prefilled requests' blocks are held for export, and until when."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

from kv_transfer.errors import EpochMismatchError, LeaseExpiredError
from kv_transfer.handle import KVHandle, KVLayout

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Lease:
    handle: KVHandle
    # The one receiver these blocks are for, when the grantor knows it (a copy it offers a named
    # peer): the lease ends as soon as that peer is known gone (`release_peer`), not at expiry.
    peer: str | None = None
    # NOTE: a lease being sent is never reaped: its blocks are read while the clock may pass expiry.
    num_transfers: int = 0


class LeaseTable:
    """Grants, validates and ends leases on prefilled requests' KV blocks. Thread-safe.

    `release(request_id)` is called exactly once per granted request, when its lease ends for any
    reason (ack, expiry, explicit release); pass e.g. `KVLending(engine).release_prefilled`, wrapped in the
    engine's lock if the engine steps on another thread. It is called without this table's lock held.
    """

    def __init__(self, worker_id: str, layout: KVLayout, release: Callable[[str], object],
                 lease_s: float = 30.0, clock: Callable[[], float] = time.time):
        assert lease_s > 0
        self.worker_id = worker_id
        self.layout = layout
        self.lease_s = lease_s
        self._release = release
        self._clock = clock
        self._lock = threading.Lock()
        self._leases: dict[str, _Lease] = {}
        # Epochs are unique per table and grow across restarts of a worker with the same id.
        self._next_epoch = time.time_ns()

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)

    def __contains__(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._leases

    def grant(self, request_id: str, block_ids: list[int], num_tokens: int, first_token: int,
              lease_s: float | None = None, peer: str | None = None) -> KVHandle:
        """Lease `block_ids` (holding `num_tokens` tokens of KV) and return the handle to give out;
        `peer`: the only receiver that may pull them (see `release_peer`).

        Granting a request again keeps its blocks and supersedes every older handle (new epoch).
        """
        assert len(block_ids) == self.layout.blocks_for_tokens(num_tokens), (
            f"{len(block_ids)} blocks for {num_tokens} tokens of block size {self.layout.block_size}")
        with self._lock:
            self._next_epoch += 1
            handle = KVHandle(self.worker_id, request_id, tuple(block_ids), num_tokens, self.layout,
                              first_token, self._next_epoch, self._clock() + (lease_s or self.lease_s))
            old = self._leases.get(request_id)
            if old is not None:
                assert old.handle.block_ids == handle.block_ids, "a re-grant must cover the same blocks"
            self._leases[request_id] = _Lease(handle, num_transfers=old.num_transfers if old else 0, peer=peer)
            return handle

    def _check(self, request_id: str, epoch: int, now: float) -> _Lease:
        lease = self._leases.get(request_id)
        if lease is None:
            raise LeaseExpiredError(f"{self.worker_id}: no live lease on {request_id!r} "
                                    "(expired, acknowledged or released); re-prefill it")
        if lease.handle.epoch != epoch:
            raise EpochMismatchError(f"{self.worker_id}: {request_id!r} epoch {epoch} was superseded by "
                                     f"{lease.handle.epoch}; use the newest handle or re-prefill")
        if now >= lease.handle.expires_at and lease.num_transfers == 0:
            raise LeaseExpiredError(f"{self.worker_id}: lease on {request_id!r} expired "
                                    f"{now - lease.handle.expires_at:.3f}s ago; re-prefill it")
        return lease

    def validate(self, request_id: str, epoch: int, now: float | None = None) -> KVHandle:
        """The live handle for (request, epoch), or `LeaseExpiredError` / `EpochMismatchError`."""
        with self._lock:
            return self._check(request_id, epoch, self._clock() if now is None else now).handle

    def begin_transfer(self, request_id: str, epoch: int) -> KVHandle:
        """`validate`, then pin the lease against reaping until `end_transfer`."""
        with self._lock:
            lease = self._check(request_id, epoch, self._clock())
            lease.num_transfers += 1
            return lease.handle

    def end_transfer(self, request_id: str) -> None:
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is not None:
                lease.num_transfers -= 1
                assert lease.num_transfers >= 0

    def ack(self, request_id: str, epoch: int | None = None) -> bool:
        """The receiver has the blocks: end the lease and free them. False if there was no such lease."""
        return self.release(request_id, epoch)

    def release(self, request_id: str, epoch: int | None = None) -> bool:
        """End the lease (if `epoch` is given, only that grant) and free its blocks."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None or (epoch is not None and lease.handle.epoch != epoch):
                return False
            del self._leases[request_id]
        self._release(request_id)
        return True

    def release_peer(self, peer: str) -> list[str]:
        """End every lease granted for `peer` alone (it died or left): their blocks are freed now
        rather than at expiry. A lease being sent is left to its transfer, which fails on its own."""
        with self._lock:
            gone = [rid for rid, lease in self._leases.items() if lease.peer == peer and lease.num_transfers == 0]
            for rid in gone:
                del self._leases[rid]
        for rid in gone:
            logger.info("%s: %s is gone; freeing the KV blocks leased to it for %s", self.worker_id, peer, rid)
            self._release(rid)
        return gone

    def reap_expired(self, now: float | None = None) -> list[str]:
        """Free every lease past its expiry that is not being sent; returns their request ids."""
        now = self._clock() if now is None else now
        with self._lock:
            dead = [rid for rid, lease in self._leases.items()
                    if now >= lease.handle.expires_at and lease.num_transfers == 0]
            for rid in dead:
                del self._leases[rid]
        for rid in dead:
            logger.info("%s: lease on %s expired; freeing its KV blocks", self.worker_id, rid)
            self._release(rid)
        return dead

    def release_all(self) -> list[str]:
        """Free every lease (worker shutdown)."""
        with self._lock:
            rids = list(self._leases)
            self._leases.clear()
        for rid in rids:
            self._release(rid)
        return rids
