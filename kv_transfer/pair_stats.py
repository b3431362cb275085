"""A KV transport that checks itself: what each pair of workers' channel is, how fast it measured when it
opened, how fast it moves KV now, and why its transfers failed.

The importing side (the decode worker, `deployments/cluster/kv_endpoint.py:KVImporter`) keeps one
`PairStats` per exporting peer in a `PairBook`:

    channel opens ─▶ probe (`probe_send` / `probe_recv`: a 1-element message, then PROBE_BYTES; the time
                     between their arrivals is the channel's own speed, without the call that asked
                     for it) ─▶ opened(peer, transport, probe GB/s, the peer's device)
    each pull     ─▶ transferred(peer, bytes, seconds)  (live GB/s: a moving average over pulls)
                  ─▶ failed(peer, exc)                  (counted by `cause_of(exc)`)

A pair whose transport is slower than its hardware allows (two caches on GPUs carried through host
memory; NCCL measuring below NCCL_SLOW_GBPS, i.e. over sockets) says so once in the log.
`listener` (optional) hears every change: the Ray glue exports the book as metrics through it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, Protocol

import torch

from kv_transfer.errors import (EpochMismatchError, LeaseExpiredError, PeerDiedError, ProtocolError,
                                TransferTimeoutError)
from kv_transfer.transport import Channel

logger = logging.getLogger(__name__)

PROBE_BYTES = 4 << 20  # large enough that a gloo / NCCL message's fixed cost is a small part of it
PROBE_TAG = 1 << 20  # above every tag the protocol uses (header/ack 0, chunks from 1)
LIVE_WEIGHT = 0.25  # weight of the latest pull in the live GB/s average
# NCCL between two GPUs below this is not NVLink, PCIe P2P or InfiniBand: NCCL fell back to sockets.
NCCL_SLOW_GBPS = 2.0


class FailureCause(str, Enum):
    """Why one transfer of a pair failed."""

    TIMEOUT = "timeout"  # a send, receive, channel set-up or ack ran past its timeout
    PEER_GONE = "peer_gone"  # the sender died or closed the channel mid-transfer
    LEASE_EXPIRED = "lease_expired"  # the sender no longer held the blocks (expired, reaped, superseded)
    CHECKSUM = "checksum"  # a corrupted or unexpected message (header checksum, size, request)
    OTHER = "other"


def cause_of(exc: BaseException) -> FailureCause:
    if isinstance(exc, TransferTimeoutError):
        return FailureCause.TIMEOUT
    if isinstance(exc, PeerDiedError):
        return FailureCause.PEER_GONE
    if isinstance(exc, (LeaseExpiredError, EpochMismatchError)):
        return FailureCause.LEASE_EXPIRED
    if isinstance(exc, ProtocolError):
        return FailureCause.CHECKSUM
    return FailureCause.OTHER


def slow_transport_note(transport: str, mine: str | None, peer: str | None, probe_gbps: float | None) -> str | None:
    """Why this pair's transport is slower than its hardware allows, or None. `mine` / `peer`: the two
    caches' device ids (`factory.device_id`; None: a CPU)."""
    if transport == "staged" and mine is not None and peer is not None:
        return (f"both KV caches are on a GPU ({mine}) but travel through pinned host memory over gloo "
                "(staged): NCCL cannot pair two ranks on one GPU; put the pools on different GPUs to use NCCL")
    if transport == "nccl" and probe_gbps is not None and probe_gbps < NCCL_SLOW_GBPS:
        return (f"NCCL measured {probe_gbps:.2f} GB/s, below {NCCL_SLOW_GBPS} GB/s: no NVLink, P2P or "
                "InfiniBand path between these GPUs, so NCCL uses TCP sockets (NCCL_DEBUG=INFO says which)")
    return None


@dataclass(slots=True)
class PairStats:
    """One (exporter `src`, importer `dst`) pair, as the importer sees it."""

    src: str
    dst: str
    transport: str | None = None  # nccl, staged, gloo, inproc; None until a channel opened
    peer_device: str | None = None
    probe_gbps: float | None = None  # measured when the channel last opened
    live_gbps: float | None = None  # moving average of the pulls
    num_transfers: int = 0
    num_bytes: int = 0
    num_opens: int = 0  # channels opened (a failure drops the channel; the next pull opens a new one)
    failures: dict[str, int] = field(default_factory=dict)  # FailureCause value -> count
    last_failure: str | None = None  # the last failure's exception type and cause
    note: str | None = None  # slow_transport_note, if any

    def as_dict(self) -> dict[str, Any]:
        rnd = lambda x: None if x is None else round(x, 3)  # noqa: E731
        return {"src": self.src, "dst": self.dst, "transport": self.transport, "peer_device": self.peer_device,
                "probe_gbps": rnd(self.probe_gbps), "live_gbps": rnd(self.live_gbps),
                "num_transfers": self.num_transfers, "num_bytes": self.num_bytes, "num_opens": self.num_opens,
                "failures": dict(self.failures), "last_failure": self.last_failure, "note": self.note}


class PairListener(Protocol):
    def opened(self, pair: PairStats) -> None: ...

    def transferred(self, pair: PairStats, nbytes: int) -> None: ...

    def failed(self, pair: PairStats, cause: FailureCause) -> None: ...


class PairBook:
    """Every pair of one importer (`me`), thread-safe. `version` goes up on every change."""

    def __init__(self, me: str, listener: PairListener | None = None):
        self.me = me
        self.listener = listener
        self.version = 0
        self._pairs: dict[str, PairStats] = {}
        self._noted: set[str] = set()
        self._lock = threading.Lock()

    def _pair(self, peer: str) -> PairStats:
        p = self._pairs.get(peer)
        if p is None:
            p = self._pairs[peer] = PairStats(peer, self.me)
        return p

    def opened(self, peer: str, transport: str, probe_gbps: float | None, peer_device: str | None = None,
               my_device: str | None = None) -> None:
        note = slow_transport_note(transport, my_device, peer_device, probe_gbps)
        with self._lock:
            p = self._pair(peer)
            p.transport, p.probe_gbps, p.peer_device, p.note = transport, probe_gbps, peer_device, note
            p.num_opens += 1
            self.version += 1
            first_note = note is not None and peer not in self._noted
            if first_note:
                self._noted.add(peer)
        if first_note:
            logger.warning("KV pair %s -> %s over %s is slower than its hardware allows: %s",
                           peer, self.me, transport, note)
        self._tell("opened", p)

    def transferred(self, peer: str, nbytes: int, seconds: float) -> None:
        with self._lock:
            p = self._pair(peer)
            p.num_transfers += 1
            p.num_bytes += nbytes
            if seconds > 0 and nbytes > 0:
                gbps = nbytes / seconds / 1e9
                p.live_gbps = gbps if p.live_gbps is None else (1 - LIVE_WEIGHT) * p.live_gbps + LIVE_WEIGHT * gbps
            self.version += 1
        self._tell("transferred", p, nbytes)

    def failed(self, peer: str, exc: BaseException) -> FailureCause:
        cause = cause_of(exc)
        with self._lock:
            p = self._pair(peer)
            p.failures[cause.value] = p.failures.get(cause.value, 0) + 1
            p.last_failure = f"{type(exc).__name__} ({cause.value})"
            self.version += 1
        self._tell("failed", p, cause)
        return cause

    def pairs(self) -> list[PairStats]:
        """Copies of every pair (a listener's `refresh` reads them outside the lock)."""
        with self._lock:
            return [replace(p, failures=dict(p.failures)) for p in self._pairs.values()]

    def get(self, peer: str) -> PairStats | None:
        with self._lock:
            return self._pairs.get(peer)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Every pair as a JSON-able dict, by exporting peer."""
        with self._lock:
            return {peer: p.as_dict() for peer, p in self._pairs.items()}

    def _tell(self, event: str, *args: Any) -> None:
        if self.listener is None:
            return
        try:
            getattr(self.listener, event)(*args)
        except Exception:  # noqa: BLE001 - statistics must never fail a transfer
            logger.debug("pair listener failed", exc_info=True)


def _probe_tensors(kv_cache: torch.Tensor, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = max(1, nbytes // kv_cache.element_size())
    return (torch.zeros(1, dtype=kv_cache.dtype, device=kv_cache.device),
            torch.zeros(n, dtype=kv_cache.dtype, device=kv_cache.device))


def probe_send(channel: Channel, kv_cache: torch.Tensor, nbytes: int, timeout_s: float) -> None:
    """The exporter's half of a probe: a 1-element message, then `nbytes` (in the cache's dtype, on its
    device, so the probe takes the path KV takes)."""
    small, big = _probe_tensors(kv_cache, nbytes)
    with channel.lock:
        sends = [channel.isend(small, PROBE_TAG), channel.isend(big, PROBE_TAG + 1)]
        for s in sends:
            s.wait(timeout_s)


class PostedProbe:
    """The importer's half, posted before the exporter is asked to send (`probe_send`); `wait` returns
    the GB/s between the two messages' arrivals. Hold `channel.lock` from `post` to `wait`."""

    def __init__(self, channel: Channel, kv_cache: torch.Tensor, nbytes: int):
        small, big = _probe_tensors(kv_cache, nbytes)
        self.nbytes = big.numel() * big.element_size()
        self._small = channel.irecv(small, PROBE_TAG)
        self._big = channel.irecv(big, PROBE_TAG + 1)

    def wait(self, timeout_s: float) -> float:
        self._small.wait(timeout_s)
        t0 = time.perf_counter()
        self._big.wait(timeout_s)
        return self.nbytes / max(time.perf_counter() - t0, 1e-9) / 1e9
