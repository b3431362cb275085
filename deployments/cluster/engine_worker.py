"""The engine worker base: one `LLMEngine` on an `EngineHost` (deployments/engine_host.py), inside a
Ray actor.

`PrefillWorker` (prefill_worker.py) and `DecodeWorker` (decode_worker.py) build on it. Actor methods run
on Ray's thread pool (max_concurrency) and touch the engine only under `self.lock` (the host's),
except block-manager calls, which may also run during a step's forward pass (`_on_blocks`). Tokens go straight
to the ingress replica's StreamHub (over hub_wire.py's socket); the decode worker's router reports
follow changes, not steps (decode_worker.py).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections import defaultdict
from typing import Any, Callable, TypeVar

import ray
import torch

from deployments import metrics, tracing
from deployments.cluster.traces import WorkerTraces
from deployments.cluster.core_share import CoreShare, node_cores, share_dir
from deployments.cluster.kv_endpoint import KVExporter, KVImporter
from deployments.cluster.messages import GenRequest, ModelInfo, Role, StreamEvent, WorkerInfo
from deployments.cluster.state import ExpiringSet
from deployments.cluster.tp_ranks import Ranks, exit_on_failed_step
from deployments.config import ServeConfig
from deployments.engine_host import EngineHost, HostHooks
from deployments.frontend.hub_wire import HubAddress, HubClient, hub_client
from engine import LLMEngine, RequestOutput
from engine.kv_lending import KVLending
from engine.device_health import is_device_fatal
from engine.parallel.worker import check_tp_model
from kv_transfer import KVHandle, KVTransferError

logger = logging.getLogger(__name__)

# An idle worker's loop wakes this often (work wakes it at once: `host.wake`): to free the blocks of
# leases that ended while it was busy, reap expired ones, and record its load. At 0.02 s an idle
# worker cost ~1% of a core, taken from a busy one on the same cores (a disaggregated CPU node).
IDLE_WAIT_S = 0.25
T = TypeVar("T")


def engine_arrival(req: GenRequest) -> float | None:
    """When the client sent `req`, on the engine's monotonic clock: a resumed or retried request keeps
    its place in the queue instead of going behind everything that arrived since."""
    if not req.arrival_time:
        return None
    return time.monotonic() - max(0.0, time.time() - req.arrival_time)


def warn_if_niced(worker_id: str) -> None:
    """Ray starts actors at nice 15 (below its own daemons and any client on the node) unless
    `RAY_worker_niceness=0` was set where Ray started (`pdserve serve` sets it; cluster.yaml too).
    NOTE: the engine does not renice itself: an engine above the router starved the router's restart
    (tests/e2e/test_faults.py); all of pdserve's actors share one niceness, set where Ray starts."""
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    if nice > 0:
        logger.info("%s: running at nice %d (Ray's worker_niceness; RAY_worker_niceness=0 where Ray starts "
                    "puts the engine level with the other processes on this node)", worker_id, nice)


class AbortMarks:
    """Attempts of requests aborted before they reached this worker's engine (`DecodeWorker.abort`
    while its `admit` or `resume` is in flight): the call drops its request when it gets that far.
    A mark no call takes (its call was refused meanwhile) goes after `ttl_s`. Caller holds the lock."""

    def __init__(self, ttl_s: float):
        self._marks = ExpiringSet(ttl_s)  # (request id, attempt or None: every attempt)

    def add(self, request_id: str, attempt: int | None) -> None:
        self._marks.add((request_id, attempt))

    def take(self, req: GenRequest) -> bool:
        """Whether `req`'s attempt was aborted (either by attempt or as a whole); forgets the marks."""
        return any([self._marks.take((req.request_id, req.attempt)), self._marks.take((req.request_id, None))])

    def __len__(self) -> int:
        return len(self._marks)


def _node_core_share(worker_id: str, config: ServeConfig) -> CoreShare | None:
    """This worker's share of its node's cores (deployments/cluster/core_share.py), or None where Ray
    cannot say which node this is."""
    try:
        node_id = ray.get_runtime_context().get_node_id()
        ray_cpus = next((n["Resources"].get("CPU") for n in ray.nodes() if n.get("NodeID") == node_id), None)
    except Exception:  # noqa: BLE001 - not in a Ray worker (tests that build one directly)
        return None
    return CoreShare(share_dir(node_id), worker_id, node_cores(ray_cpus), config.engine.num_threads or 1)


class EngineWorker:
    """What both kinds of worker share: the engine, its step loop and lock, the KV importer, and the
    actor methods the router calls on any worker (info, ping, watch, abort, integrity check)."""

    role: Role  # set by each subclass (a `RoleWorker`'s changes: role_worker.py)
    kv_exporter: KVExporter  # `_init_exporter`: every kind of worker exports KV

    def __init__(self, worker_id: str, config: ServeConfig, router: Any):
        torch.set_num_threads(config.engine.num_threads)
        warn_if_niced(worker_id)
        self.worker_id = worker_id
        self.config = config
        self.router = router
        tracing.configure(config.otlp_endpoint, config.trace_exporter, f"pdserve-{self.role.value}")
        self.traces = WorkerTraces(worker_id)  # spans of traced requests (cluster/traces.py)
        engine_config = config.engine_config(self.role.value)
        # Tensor parallelism: this actor is rank 0; it starts the other ranks in its placement group.
        self.ranks: Ranks | None = None
        if engine_config.tensor_parallel_size > 1:
            check_tp_model(engine_config)  # a size the model cannot split: refused before any rank starts
            self.ranks = Ranks(worker_id, engine_config, config.worker_num_cpus, config.worker_num_gpus)
        try:
            self.engine = LLMEngine(engine_config, tp_group=self.ranks.group if self.ranks else None)
        except BaseException:
            if self.ranks is not None:
                self.ranks.kill()
            raise
        self.lending = KVLending(self.engine)  # the engine's side of KV transfer
        # Structured requests' waits for their grammar, drained after each step into `grammar.compile` spans.
        self._grammar_waits = self.engine.watch_grammar_waits()
        on_cpu = torch.device(self.engine.config.device).type == "cpu"
        share = _node_core_share(worker_id, config) if on_cpu and config.share_node_cores else None
        self.host = EngineHost(self.engine, worker_id, HostHooks(
            after_step=self._stepped, step_failed=self._step_failed, before_step=self._settle,
            idle=self._idle_and_record), share=share, idle_wait_s=IDLE_WAIT_S, exit_on_device_loss=True)
        self.lock = self.host.lock
        # Blocks this worker holds a reference on for an export (`KVExporter.grant_blocks`), by lease.
        self._pinned: dict[str, list[int]] = {}
        self._lease_ids = itertools.count()
        # Decode workers pull prefilled prompts with it; prefill workers, copies of prompts a decode
        # worker prefilled itself (`PrefillWorker.kv_backup`).
        self.kv_importer = KVImporter(worker_id, self.engine, engine_lock=self.lock,
                                      timeout_s=config.kv_transfer_timeout_s, on_blocks=self._on_blocks)
        self._closed = threading.Event()
        self.requests: dict[str, GenRequest] = {}
        self.num_orphans = 0  # requests aborted here because their client was gone (`_sweep_orphans`)
        self._swept: dict[str, GenRequest] = {}  # the requests held at the last sweep
        # Attempts aborted before they got here (the call that brings one, an `add`, `admit` or `resume`,
        # was in flight: Ray runs this actor's calls on a thread pool, in any order): (request id,
        # attempt) -> when; the call drops its request when it gets that far.
        self._aborted = AbortMarks(ttl_s=max(120.0, 4 * config.kv_transfer_timeout_s))

    def _init_exporter(self) -> None:
        """Every kind of worker exports KV (a prefill worker its prompts, a decode worker KV backups and
        cached prefixes): the roles' `__init__`s call this once."""
        self.kv_exporter = KVExporter(self.worker_id, self.engine, engine_lock=self.lock,
                                      lease_s=self.config.kv_lease_s, free=self._free_lease)

    @property
    def num_steps(self) -> int:
        return self.host.num_steps

    @property
    def max_step_threads(self) -> int:
        """The most threads a step has used (its share of the node's cores)."""
        return self.host.max_step_threads

    def _start(self) -> None:
        """Subclasses call this last in __init__, once everything the loop touches exists."""
        self.host.start()
        threading.Thread(target=self._orphan_loop, name=f"{self.worker_id}-orphans", daemon=True).start()

    # ------------------------------------------------------------------ requests whose client is gone
    def _orphan_loop(self) -> None:
        while not self._closed.wait(self.config.client_check_s):
            try:
                self._sweep_orphans()
            except Exception:  # noqa: BLE001 - the next sweep tries again
                logger.exception("%s: orphan sweep failed", self.worker_id)

    def _sweep_orphans(self) -> int:
        """Abort the requests whose client is gone: their ingress hub no longer streams them (or no
        longer listens). The client's own abort does this at once; this is the backstop for one that
        never arrived (lost between the door, the router and this worker), so that a request never
        holds a slot and its blocks after its client left. A request is asked about once it was here
        at two sweeps in a row (`client_check_s` apart). Returns how many were aborted."""
        with self.lock:
            now = {rid: req for rid, req in self.requests.items() if req.hub is not None}
        asked = [req for rid, req in now.items() if self._swept.get(rid) is req]  # here a while
        self._swept = now
        by_hub: dict[HubAddress, list[GenRequest]] = defaultdict(list)
        for req in asked:
            by_hub[req.hub].append(req)
        gone: list[GenRequest] = []
        aborted = 0
        for hub, reqs in by_hub.items():
            try:
                held = HubClient.held(hub, [r.request_id for r in reqs], timeout_s=10.0)
            except ConnectionRefusedError:
                held = set()  # its replica is gone, and its clients with it
            except (OSError, EOFError) as exc:  # unreachable for now: ask again next time
                logger.info("%s: stream hub %r not asked (%r)", self.worker_id, hub, exc)
                continue
            gone += [r for r in reqs if r.request_id not in held]
        for req in gone:
            with self.lock:
                if self.requests.get(req.request_id) is not req:
                    continue  # finished or moved meanwhile
                logger.warning("%s: %s has no client any more; aborting it", self.worker_id, req.request_id)
                self.abort(req.request_id, req.attempt)
                self.num_orphans += 1
                aborted += 1
            self.router.abort.remote(req.request_id)  # the router forgets it (if it still tracks it)
        return aborted

    def _on_blocks(self, fn: Callable[[], T], timeout_s: float | None = None) -> T:
        """Run `fn`, which may only call the engine's block-manager methods, under the engine lock or
        during a step's forward pass (`EngineHost.on_blocks`). TimeoutError after `timeout_s`."""
        return self.host.on_blocks(fn, timeout_s or self.config.kv_transfer_timeout_s)

    def _free_lease(self, lease_id: str) -> None:
        """`KVExporter`'s `free`: drop a lease's blocks (caller holds the lock)."""
        blocks = self._pinned.pop(lease_id, None)
        if blocks is not None:
            self.lending.free_blocks(blocks)
        else:
            self.lending.release_prefilled(lease_id)

    # ------------------------------------------------------------------ actor API
    def info(self) -> WorkerInfo:
        e = self.engine
        return WorkerInfo(self.worker_id, self.role, ModelInfo(e.model_dir, e.max_model_len, e.vocab_size),
                          e.block_manager.num_blocks, e.block_manager.block_size, ray.util.get_node_ip_address(),
                          ray.get_runtime_context().get_node_id(), device=str(e.runner.kv_cache.device),
                          num_threads=e.config.num_threads or 0)

    def ping(self) -> str:
        return self.worker_id

    def tp_followers(self) -> list[Any]:
        """The actors of this worker's ranks 1..N-1 (tests, tools); [] for a TP-1 worker."""
        return list(self.ranks.actors) if self.ranks is not None else []

    def abort(self, request_id: str, attempt: int | None = None, in_flight: bool = False) -> bool:
        """End `request_id` here: only its attempt `attempt`, if given (the router gave up on that one
        and may have placed the next one here already). `in_flight`: the call that brings it here
        may still be on its way: one not here yet is dropped when it gets here (`AbortMarks`)."""
        with self.lock:
            req = self.requests.get(request_id)
            if req is None and in_flight:
                self._aborted.add(request_id, attempt)
            if req is not None and attempt is not None and req.attempt != attempt:
                return False
            self.requests.pop(request_id, None)
            return self.engine.abort(request_id)

    def num_abort_marks(self) -> int:
        with self.lock:
            return len(self._aborted)

    def check_integrity(self) -> dict:
        """Runs the block manager's integrity check; returns block use for the caller's assertions."""
        with self.lock:
            self._settle()
            self.engine.check_integrity()
            bm = self.engine.block_manager
            return {"num_used_blocks": bm.num_used_blocks, "num_free_blocks": bm.num_free_blocks,
                    "num_requests": len(self.requests), "num_steps": self.num_steps,
                    "num_orphans": self.num_orphans, "max_step_threads": self.max_step_threads,
                    "num_cached_tokens": self.engine.scheduler.num_cached_tokens}

    def shutdown(self) -> None:
        self.host.stop(timeout_s=0.0)
        if self.ranks is not None:
            self.ranks.kill()  # closing: their ends are no failure (the router removes the placement group)
        self._closed.set()

    def num_requests(self) -> int:
        with self.lock:
            return len(self.requests)

    def connect_kv(self, peer_id: str, peer_actor: Any) -> bool:
        """Open the KV channel that pulls from `peer_id` ahead of the first pull; False if it failed (the
        first pull then tries again)."""
        try:
            self.kv_importer.connect(peer_id, peer_actor)
            return True
        except KVTransferError as exc:
            self._exit_if_device_broken(exc)
            logger.warning("%s: could not open a KV channel to %s: %r", self.worker_id, peer_id, exc)
            return False

    def watch(self, timeout_s: float = 300.0) -> bool:
        """Returns True when this worker shuts down, False after `timeout_s`. The router keeps one call
        in flight per worker: if the process dies the call fails at once, so the death is noticed
        without waiting for a ping."""
        return self._closed.wait(timeout_s)

    # ------------------------------------------------------------------ loop
    def _idle(self) -> None:
        pass

    def _settle(self) -> None:
        """Deferred bookkeeping the engine must see before it is stepped or checked (caller holds the
        lock): free the blocks of leases that ended, and reap expired ones while this worker holds
        pinned blocks (a peer that leased them may never pull them)."""
        self.kv_exporter.free_released()
        if self._pinned:
            self.kv_exporter.reap_expired()

    def _grant_pinned(self, lease_id: str, block_ids: list[int], peer: str | None = None) -> KVHandle:
        """Lease full blocks this worker holds a reference on, for worker `peer` to pull; `_free_lease`
        drops it when the lease ends (the peer's ack, its death, or expiry)."""
        self._pinned[lease_id] = block_ids
        bs = self.engine.block_manager.block_size
        return self.kv_exporter.grant_blocks(lease_id, block_ids, len(block_ids) * bs, peer=peer)

    def _idle_and_record(self) -> None:
        self._idle()
        with self.lock:
            metrics.record_load(self.role.value, self.worker_id, self.engine)

    def _stepped(self, outs: list[RequestOutput], stats) -> None:
        with self.lock:
            metrics.record_step(self.role.value, self.worker_id, stats, self.engine)
            waits = self._grammar_waits.take()
        if waits:  # before the outputs end their requests' spans
            self.traces.grammar_waits(waits)
        self._after_step(outs, stats)

    def _step_failed(self, exc: BaseException) -> None:
        if self.ranks is not None:
            exit_on_failed_step(self.worker_id, exc)
        # NOTE: the client sees a generic message; the exception text stays in the worker's log. Only the
        # requests the step held end (`LLMEngine.step_request_ids`; all of them if it failed before it
        # scheduled), as in the single-process layout: the others keep going.
        self._fail_all(f"generation failed: the {self.role.value} step failed ({type(exc).__name__})",
                       self.engine.step_request_ids)

    def _exit_if_device_broken(self, exc: BaseException) -> None:
        """A sticky device error (a broken CUDA context) on a KV channel: exit the process, so the router
        sees a death and moves this worker's requests (a failed step does the same: `EngineHost`)."""
        if is_device_fatal(exc, self.engine.config.device):
            logger.critical("%s: device context broken (%r); exiting so the work moves elsewhere",
                            self.worker_id, exc)
            os._exit(1)

    def _fail_all(self, message: str, only: list[str] | None = None) -> None:
        """End this worker's requests (those of `only` when given) with `message`."""
        with self.lock:
            ids = list(self.requests) if only is None else [rid for rid in only if rid in self.requests]
            reqs = [self.requests.pop(rid) for rid in ids]
            for r in reqs:
                self.engine.abort(r.request_id)
        self._push([StreamEvent(r.request_id, r.offset, [], True, "error", message) for r in reqs], reqs)
        for r in reqs:
            self.router.on_finished.remote(self.worker_id, r.request_id)

    def _push(self, events: list[StreamEvent], reqs: list[GenRequest]) -> None:
        """One frame per ingress hub with all of this step's events (sent by a thread: never blocks)."""
        by_hub: dict[HubAddress, list[StreamEvent]] = defaultdict(list)
        for ev, req in zip(events, reqs):
            by_hub[req.hub].append(ev)
        client = hub_client()
        for hub, evs in by_hub.items():
            client.push(hub, evs)

    def _after_step(self, outs: list[RequestOutput], stats) -> None:
        raise NotImplementedError

