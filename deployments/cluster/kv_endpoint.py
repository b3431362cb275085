"""Ray glue for KV transfer: `KVExporter` lives in a prefill actor, `KVImporter` in a decode actor.

Both kinds of worker have both: the other way round, a prefill worker pulls a copy of a prompt a
decode worker computed itself into its prefix cache (KV backup, `PrefillWorker.kv_backup`), over a
channel of its own. Below, "prefill" and "decode" name the usual direction.

    decode actor (KVImporter.pull)                      prefill actor (KVExporter, via KVExportMixin)
    first pull from this exporter only:
      ray.get(exporter.kv_open_channel(me)) ----------->  listen: gloo rank 0 (TCPStore) -> (node ip, port)
                                                           or NCCL rank 0 -> unique id
      connect rank 1  <------------ rendezvous ------->
    allocate blocks (ReceiverOutOfBlocksError)
    lock channel; exporter.kv_push(handle, me) -------->  pin lease, send header + blocks, wait ack
    receive, check header, unpack, ack  --------------->  release_prefilled(request) on ack
    return block ids -> KVLending.add_prefilled_request

A tensor-parallel worker (rank 0 of its group) sends and receives blocks with every KV head
(`wire_layout`): its exporter gathers them from its ranks before the send, its importer scatters
them to its ranks after the receive (engine/parallel/kv_shards.py), so workers of any TP degrees pair.

Any failure raises a `kv_transfer.KVTransferError` subclass on the decode side with the blocks on both
sides freed (the exporter frees on its own failures; a pull that fails before the push starts tells
it to); the caller re-prefills the request. Leases expire as the last resort (`reap_expired`).

Usage in the actors (prefill_worker.py, decode_worker.py; an exporting actor must accept concurrent
calls: `max_concurrency` >= 2 plus the number of peers, since `kv_push` blocks for a transfer):

    @ray.remote(max_concurrency=16)
    class PrefillWorker(KVExportMixin, EngineWorker):
        def __init__(self, ...):
            self.kv_exporter = KVExporter(worker_id, engine, engine_lock=self.lock, free=self._free_lease)
        ...   out = prefilled RequestOutput -> handle = self.kv_exporter.grant(out, num_prompt_tokens)

    @ray.remote(max_concurrency=32)
    class DecodeWorker(KVExportMixin, EngineWorker):   # EngineWorker makes `self.kv_importer`
        def admit(self, req, handle, prefill_actor):
            block_ids = self.kv_importer.pull(handle, prefill_actor)
            with self.lock:
                self.lending.add_prefilled_request(req.request_id, req.prompt_token_ids, [handle.first_token],
                                             req.params, block_ids, handle.num_tokens)
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import threading
import time
from typing import Any, Callable

import ray

from deployments import metrics
from engine import LLMEngine, RequestOutput
from engine.kv_lending import KVLending
from kv_transfer.nccl import pin_interface
from kv_transfer.pair_stats import PROBE_BYTES, PairBook, PostedProbe, probe_send
from kv_transfer import (KVHandle, KVLayout, KVReceiver, KVSender, KVTransferError, LeaseTable, PeerDiedError,
                         ReceiverOutOfBlocksError, TransferTimeoutError, make_transport)

logger = logging.getLogger(__name__)


def _node_ip(host: str | None) -> str:
    return host or ray.util.get_node_ip_address()


def _tp_runner(engine: LLMEngine) -> Any:
    """The engine's runner when it is rank 0 of a tensor-parallel group (its cache holds only rank 0's
    KV heads), else None."""
    runner = engine.runner
    return runner if runner.tp.world > 1 else None


def wire_layout(engine: LLMEngine) -> KVLayout:
    """The layout blocks travel in: every KV head of the model, whatever each side's TP degree
    (rank 0 gathers from / scatters to its followers: engine.parallel.kv_shards)."""
    layout = KVLayout.of(engine.runner.kv_cache)
    if _tp_runner(engine) is None:
        return layout
    from engine.parallel.kv_shards import full_kv_heads

    return dataclasses.replace(layout, num_kv_heads=full_kv_heads(engine.runner.config))


def _transport(device: Any, node_ip: str, timeout_s: float, compute_stream: Any = None) -> Any:
    """The KV transport for a cache on `device`; its listeners bind to `node_ip`, the node's cluster
    address, only (gloo: given it; NCCL: through the interface holding it, `pin_interface`)."""
    if getattr(device, "type", str(device).split(":")[0]) == "cuda":
        pin_interface(node_ip)
    return make_transport(device, node_ip, timeout_s, compute_stream)


class KVExporter:
    """Prefill side: leases on prefilled requests, gloo channels to decode workers, pushes.

    Thread-safe. `engine_lock` guards every engine call made here (releasing blocks); pass the lock
    the actor steps its engine under.
    """

    def __init__(self, worker_id: str, engine: LLMEngine, *, engine_lock: Any = None, lease_s: float = 30.0,
                 timeout_s: float = 30.0, host: str | None = None, free: Callable[[str], object] | None = None):
        """`free(lease id)`: what frees a lease's blocks, under the engine lock (default: the engine's
        `release_prefilled`; a decode worker exporting a copy of blocks it pinned passes its own)."""
        self.worker_id = worker_id
        self._engine, self._lock = engine, engine_lock or threading.RLock()
        self._free = free or KVLending(engine).release_prefilled
        self._ended: collections.deque[str] = collections.deque()  # leases ended, blocks not yet freed
        kv_cache = engine.runner.kv_cache
        # per peer: gloo for a CPU cache; NCCL, or staged gloo for a peer on the same GPU, for a CUDA one
        stream = getattr(engine.runner, "compute_stream", None)  # CUDA: the engine's stream
        self.transport = _transport(kv_cache.device, _node_ip(host), timeout_s, stream)
        self.leases = LeaseTable(worker_id, wire_layout(engine), self._release_blocks, lease_s)
        tp = _tp_runner(engine)
        gather = None
        if tp is not None:
            from engine.parallel.kv_shards import gather_kv

            gather = functools.partial(gather_kv, tp)
        self.sender = KVSender(self.transport, kv_cache, self.leases, timeout_s, gather=gather)

    def _release_blocks(self, request_id: str) -> None:
        # NOTE: never wait for the engine lock here: the prefill loop holds it for a whole step
        # (seconds on a CPU), and the push that ends a lease must return at once, or the decode
        # worker waiting on it admits the request a step late. The loop frees them after its step.
        self._ended.append(request_id)
        self.free_released(blocking=False)

    def free_released(self, blocking: bool = True) -> int:
        """Free the blocks of leases that ended (ack, failure, expiry). Non-blocking: if the engine is
        busy, leave them for its loop, which calls this before every step. Returns how many."""
        if not self._lock.acquire(blocking=blocking):
            return 0
        try:
            n = 0
            while self._ended:
                self._free(self._ended.popleft())
                n += 1
            return n
        finally:
            self._lock.release()

    def grant(self, output: RequestOutput, num_prompt_tokens: int, lease_s: float | None = None) -> KVHandle:
        """Lease a request that finished with `finish_reason == "prefilled"`; give the handle to a decode
        worker. Its blocks are freed on that worker's ack, on any transfer failure, or on expiry."""
        assert output.finish_reason == "prefilled" and output.block_ids is not None, output.finish_reason
        return self.leases.grant(output.request_id, output.block_ids, num_prompt_tokens, output.token_ids[0], lease_s)

    def grant_blocks(self, lease_id: str, block_ids: list[int], num_tokens: int, lease_s: float | None = None,
                     peer: str | None = None) -> KVHandle:
        """Lease blocks the caller holds a reference on (`free(lease_id)` drops it when the lease ends);
        `peer`: the worker they are for, whose death (`forget`) ends the lease at once."""
        return self.leases.grant(lease_id, block_ids, num_tokens, -1, lease_s, peer)

    def open_channel(self, peer_id: str, peer_device: str | None = None) -> Any:
        """Host a fresh channel to decode worker `peer_id`, whose KV cache is on device `peer_device`
        (`kv_transfer.factory.device_id`; None: a CPU); returns the address it connects to (the wire
        the pair of devices needs, with (node ip, port) for gloo or the unique id for NCCL)."""
        return self.transport.listen(peer_id, peer_device)

    def push(self, handle: KVHandle, peer_id: str) -> None:
        """Send `handle`'s blocks to `peer_id` (which is in `KVImporter.pull`); returns after its ack."""
        self.sender.push(handle, peer_id)

    def probe(self, peer_id: str, nbytes: int) -> str | None:
        """The sending half of the probe of a channel `peer_id` just opened (`pair_stats.probe_send`);
        returns this cache's device id (None: a CPU) for the importer's transport check."""
        probe_send(self.transport.channel(peer_id), self.sender.kv_cache, nbytes, self.sender.timeout_s)
        return self.transport.device_id

    def release(self, request_id: str, epoch: int) -> bool:
        """Drop the lease (the decode side gave up before the push); False if already gone or superseded."""
        return self.leases.release(request_id, epoch)

    def reap_expired(self) -> list[str]:
        """Free expired leases; call it periodically (e.g. from the engine loop when idle)."""
        return self.leases.reap_expired()

    def stats(self) -> dict[str, int]:
        s = self.sender
        return {"num_sent": s.num_sent, "num_failed": s.num_failed, "bytes_sent": s.bytes_sent,
                "num_leases": len(self.leases)}

    def forget(self, peer_id: str) -> None:
        """`peer_id` is dead or drained: close the channel to it (and its sockets), and free the blocks
        leased to it alone (a copy it was to pull)."""
        self.transport.drop(peer_id)
        self.leases.release_peer(peer_id)

    def close(self) -> None:
        self.transport.close()
        self.leases.release_all()
        self.free_released()


def channel_peers(transport: Any) -> list[str]:
    """The peers `transport` holds a channel to, open or broken (what `kv_channels` reports)."""
    with transport._lock:  # NOTE: Transport has no public listing; read under its own lock
        return sorted(transport._channels)


class KVExportMixin:
    """The actor methods `KVImporter.pull` calls on a prefill actor, and the ones the router calls on
    any worker about its KV channels. The actor sets `self.kv_exporter` (and `self.kv_importer`)."""

    kv_exporter: KVExporter
    kv_importer: KVImporter

    def kv_forget_peer(self, peer_id: str) -> None:
        """The router saw `peer_id` die or leave its pool: close both channels to it, so that no
        socket stays open to a peer that is gone (a peer that comes back gets fresh ones)."""
        self.kv_exporter.forget(peer_id)
        self.kv_importer.forget(peer_id)

    def kv_channels(self) -> dict[str, list[str]]:
        """The peers this worker holds KV channels to, by direction (tests, leak checks)."""
        return {"export": channel_peers(self.kv_exporter.transport),
                "import": channel_peers(self.kv_importer.transport)}

    def kv_open_channel(self, peer_id: str, peer_device: str | None = None) -> Any:
        return self.kv_exporter.open_channel(peer_id, peer_device)

    def kv_push(self, handle: KVHandle, peer_id: str) -> None:
        self.kv_exporter.push(handle, peer_id)

    def kv_probe(self, peer_id: str, nbytes: int) -> str | None:
        return self.kv_exporter.probe(peer_id, nbytes)

    def kv_release(self, request_id: str, epoch: int) -> bool:
        return self.kv_exporter.release(request_id, epoch)


class KVImporter:
    """Decode side: pulls a handle's blocks from the prefill actor that holds them. Thread-safe; one
    importer may pull from many exporters, and run several pulls at once (serialized per channel)."""

    def __init__(self, worker_id: str, engine: LLMEngine, *, engine_lock: Any = None, timeout_s: float = 30.0,
                 host: str | None = None, on_blocks: Callable[[Callable[[], Any]], Any] | None = None):
        """`on_blocks(fn)` runs a block-manager call (allocating or freeing the receiving blocks); default:
        under `engine_lock`. A worker passes one that may run it during its step's forward pass."""
        self.worker_id = worker_id
        self._engine, self._lock = engine, engine_lock or contextlib.nullcontext()
        self._lending = KVLending(engine)
        self._on_blocks = on_blocks or self._locked
        self.timeout_s = timeout_s
        self.transport = _transport(engine.runner.kv_cache.device, _node_ip(host), timeout_s,
                                    getattr(engine.runner, "compute_stream", None))
        tp = _tp_runner(engine)
        shards = {}
        if tp is not None:
            from engine.parallel.kv_shards import scatter_kv

            shards = {"layout": wire_layout(engine), "scatter": functools.partial(scatter_kv, tp)}
        self.receiver = KVReceiver(self.transport, engine.runner.kv_cache, self._allocate, self._free, timeout_s,
                                   **shards)
        # per exporting peer: transport, probe and live GB/s, transfers, failures by cause (/health, metrics)
        self.pairs = PairBook(worker_id, metrics.KVPairMetrics())
        self._open_locks: dict[str, threading.Lock] = {}
        self._open_locks_lock = threading.Lock()
        self._pushes: list[tuple[ray.ObjectRef, str]] = []  # acked pushes whose return is not yet seen

    def _locked(self, fn: Callable[[], Any]) -> Any:
        with self._lock:
            return fn()

    def _allocate(self, num_tokens: int) -> list[int] | None:
        try:
            return self._on_blocks(lambda: self._lending.allocate_blocks(num_tokens, contiguous=True))
        except TimeoutError as e:
            raise TransferTimeoutError(f"no KV blocks to receive into: {e}") from None

    def _free(self, block_ids: list[int]) -> None:
        self._on_blocks(lambda: self._lending.free_blocks(block_ids))

    def connect(self, peer: str, exporter: ray.actor.ActorHandle, timeout_s: float | None = None) -> None:
        """Open the channel to exporter `peer` now, so that the first pull from it does not pay for the
        rendezvous (a TCP store, a gloo group or an NCCL communicator: seconds on a busy CPU node)."""
        self._ensure_channel(peer, exporter, timeout_s or self.timeout_s)

    def _ensure_channel(self, peer: str, exporter: ray.actor.ActorHandle, timeout_s: float) -> None:
        with self._open_locks_lock:
            lock = self._open_locks.setdefault(peer, threading.Lock())
        with lock:
            if self.transport.has_channel(peer):
                return
            try:
                # The exporter picks the backend from both devices (one GPU: staged gloo, not NCCL).
                device = self.transport.device_id
                mine = {"peer_device": device} if device is not None else {}
                address = ray.get(exporter.kv_open_channel.remote(self.worker_id, **mine), timeout=timeout_s)
            except ray.exceptions.GetTimeoutError:
                raise TransferTimeoutError(f"{peer} did not open a KV channel in {timeout_s:.1f}s") from None
            except ray.exceptions.RayActorError as e:
                raise PeerDiedError(f"{peer} died before opening a KV channel: {e}") from None
            self.transport.connect(peer, address)
            self._probe(peer, exporter, timeout_s)

    def _probe(self, peer: str, exporter: ray.actor.ActorHandle, timeout_s: float) -> None:
        """Measure the channel just opened to `peer` (kv_transfer/pair_stats.py) and book it. A probe that
        fails drops the channel and raises, as the first transfer over it would have."""
        kind = self.transport.kind_of(peer)
        transport = kind.value if kind is not None else type(self.transport).__name__
        try:
            probe_call = exporter.kv_probe
        except AttributeError:  # an exporter without the probe (tests' hand-made actors): book it unmeasured
            self.pairs.opened(peer, transport, None, my_device=self.transport.device_id)
            return
        channel = self.transport.channel(peer)
        try:
            with channel.lock:
                posted = PostedProbe(channel, self.receiver.kv_cache, PROBE_BYTES)
                ref = probe_call.remote(self.worker_id, PROBE_BYTES)
                gbps = posted.wait(timeout_s)
            peer_device = ray.get(ref, timeout=timeout_s)
        except BaseException as e:
            self.transport.drop(peer, channel)
            if isinstance(e, ray.exceptions.RayActorError):
                raise PeerDiedError(f"{peer} died while probing the KV channel: {e}") from None
            if isinstance(e, ray.exceptions.GetTimeoutError):
                raise TransferTimeoutError(f"{peer} did not finish the KV channel probe in {timeout_s:.1f}s") from None
            raise
        self.pairs.opened(peer, transport, gbps, peer_device, self.transport.device_id)

    def pull(self, handle: KVHandle, exporter: ray.actor.ActorHandle, timeout_s: float | None = None) -> list[int]:
        """Fetch `handle`'s KV into newly allocated blocks of this engine and return their ids.

        `exporter` is the actor (with `KVExportMixin`) named by `handle.worker_id`. When this returns
        the exporter has our ack and frees its copy on its own; hand the ids to
        `KVLending.add_prefilled_request`. Raises a
        `KVTransferError` subclass, with nothing held on either side, if the request must be re-prefilled.
        """
        timeout_s = timeout_s or self.timeout_s
        try:
            block_ids, seconds = self._pull(handle, exporter, timeout_s)
        except ReceiverOutOfBlocksError:
            raise  # this worker's room, not the pair's health
        except KVTransferError as e:
            self.pairs.failed(handle.worker_id, e)
            raise
        self.pairs.transferred(handle.worker_id, handle.nbytes, seconds)
        return block_ids

    def _pull(self, handle: KVHandle, exporter: ray.actor.ActorHandle, timeout_s: float) -> tuple[list[int], float]:
        """`pull`'s work; also returns the seconds of the transfer itself (the push call, header, blocks and
        ack: not the channel's opening), for the pair's live GB/s."""
        self._reap_pushes()
        push_ref: list[ray.ObjectRef] = []

        def start_push() -> None:
            push_ref.append(exporter.kv_push.remote(handle, self.worker_id))

        def abandon() -> None:
            exporter.kv_release.remote(handle.request_id, handle.epoch)

        try:
            self._ensure_channel(handle.worker_id, exporter, timeout_s)
        except KVTransferError:
            abandon()
            raise
        t0 = time.perf_counter()
        try:
            block_ids = self.receiver.receive(handle, start_push, abandon, timeout_s)
        except TransferTimeoutError as e:
            if push_ref and self._actor_died(push_ref[0]):
                raise PeerDiedError(f"{handle.worker_id} died while sending {handle.request_id!r}") from e
            raise
        # NOTE: not waiting for the push to return: that is one more Ray round trip on the admission
        # path, and the exporter frees its copy on our ack by itself. Its result is only logged.
        seconds = time.perf_counter() - t0
        with self._open_locks_lock:
            self._pushes.append((push_ref[0], handle.request_id))
        return block_ids, seconds

    def _reap_pushes(self) -> None:
        with self._open_locks_lock:
            pushes, self._pushes = self._pushes, []
        if not pushes:
            return
        done, _ = ray.wait([r for r, _ in pushes], num_returns=len(pushes), timeout=0)
        done = set(done)
        for ref, rid in pushes:
            if ref not in done:
                with self._open_locks_lock:
                    self._pushes.append((ref, rid))
                continue
            try:
                ray.get(ref, timeout=0)
            except Exception:  # noqa: BLE001 - after our ack: the KV is here, the request goes on
                logger.warning("exporter failed after acking %s", rid, exc_info=True)

    @staticmethod
    def _actor_died(ref: ray.ObjectRef) -> bool:
        try:
            ray.get(ref, timeout=1.0)
        except ray.exceptions.RayActorError:
            return True
        except Exception:
            return False
        return False

    def stats(self) -> dict[str, int]:
        self._reap_pushes()
        r = self.receiver
        return {"num_received": r.num_received, "num_failed": r.num_failed, "bytes_received": r.bytes_received}

    def forget(self, peer_id: str) -> None:
        """`peer_id` is dead or drained: close the channel to it (and its sockets)."""
        with self._open_locks_lock:
            self._open_locks.pop(peer_id, None)
        self.transport.drop(peer_id)

    def close(self) -> None:
        self.transport.close()
