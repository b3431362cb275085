"""Prefill and decode worker actors. Each owns one `LLMEngine` stepped by one background thread.

Actor methods run on Ray's thread pool (max_concurrency) and touch the engine only under `self.lock`,
except block-manager calls, which may also run during a step's forward pass (`_on_blocks`).
Tokens go straight to the ingress replica's StreamHub; the router gets one small message per step.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections import defaultdict
from typing import Any, Callable, TypeVar

import ray
import torch

from deployments import metrics
from deployments.config import ServeConfig
from deployments.cluster.kv_endpoint import KVExporter, KVExportMixin, KVImporter
from deployments.cluster.messages import DecodeReport, GenRequest, StreamEvent
from engine import LLMEngine, RequestOutput
from kv_transfer import KVHandle, KVTransferError

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.02
T = TypeVar("T")


def _engine_arrival(req: GenRequest) -> float | None:
    """When the client sent `req`, on the engine's monotonic clock: a resumed or retried request keeps
    its place in the queue instead of going behind everything that arrived since."""
    if not req.arrival_time:
        return None
    return time.monotonic() - max(0.0, time.time() - req.arrival_time)


class _EngineWorker:
    role = "worker"
    kv_exporter: KVExporter  # each subclass makes one: both kinds of worker export KV

    def __init__(self, worker_id: str, config: ServeConfig, router: Any):
        torch.set_num_threads(config.engine.num_threads)
        self.worker_id = worker_id
        self.config = config
        self.router = router
        self.engine = LLMEngine(config.engine_config(self.role))
        self.lock = threading.RLock()
        # The forward pass of a step holds `lock` but touches no block-manager state: `_on_blocks`
        # runs a block-manager call meanwhile instead of after the step (seconds on a CPU thread).
        self._window = threading.Lock()
        self._in_forward = False
        # Blocks this worker holds a reference on for an export (`KVExporter.grant_blocks`), by lease.
        self._pinned: dict[str, list[int]] = {}
        self._lease_ids = itertools.count()
        # Decode workers pull prefilled prompts with it; prefill workers, copies of prompts a decode
        # worker prefilled itself (`PrefillWorker.kv_backup`).
        self.kv_importer = KVImporter(worker_id, self.engine, engine_lock=self.lock,
                                      timeout_s=config.kv_transfer_timeout_s, on_blocks=self._on_blocks)
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._alive = True
        self.requests: dict[str, GenRequest] = {}
        self.num_steps = 0
        self._thread = threading.Thread(target=self._loop, name=f"{worker_id}-loop", daemon=True)

    def _start(self) -> None:
        """Subclasses call this last in __init__, once everything the loop touches exists."""
        self._thread.start()

    @contextlib.contextmanager
    def _forward(self):
        """Entered by the loop (holding `lock`) around a step's forward pass."""
        with self._window:
            self._in_forward = True
        try:
            yield
        finally:
            with self._window:
                self._in_forward = False

    def _on_blocks(self, fn: Callable[[], T], timeout_s: float | None = None) -> T:
        """Run `fn`, which may only call the engine's block-manager methods (allocate, free, take or
        cache blocks; nothing about requests), under the engine lock, or during the forward pass of
        the step that holds it. TimeoutError after `timeout_s`."""
        timeout_s = timeout_s or self.config.kv_transfer_timeout_s
        deadline = time.monotonic() + timeout_s
        while True:
            if self.lock.acquire(timeout=0.005):
                try:
                    return fn()
                finally:
                    self.lock.release()
            with self._window:
                if self._in_forward:  # the loop holds the lock, inside the forward pass
                    return fn()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.worker_id}: engine busy for {timeout_s}s")

    def _free_lease(self, lease_id: str) -> None:
        """`KVExporter`'s `free`: drop a lease's blocks (caller holds the lock)."""
        blocks = self._pinned.pop(lease_id, None)
        if blocks is not None:
            self.engine.free_blocks(blocks)
        else:
            self.engine.release_prefilled(lease_id)

    # ------------------------------------------------------------------ actor API
    def info(self) -> dict:
        e = self.engine
        return {"worker_id": self.worker_id, "role": self.role, "model_dir": e.model_dir,
                "max_model_len": e.max_model_len, "vocab_size": e.vocab_size,
                "num_blocks": e.block_manager.num_blocks, "block_size": e.block_manager.block_size,
                "node_ip": ray.util.get_node_ip_address(), "node_id": ray.get_runtime_context().get_node_id()}

    def ping(self) -> str:
        return self.worker_id

    def abort(self, request_id: str) -> bool:
        with self.lock:
            self.requests.pop(request_id, None)
            return self.engine.abort(request_id)

    def check_integrity(self) -> dict:
        """Runs the block manager's integrity check; returns block use for the caller's assertions."""
        with self.lock:
            self._settle()
            self.engine.check_integrity()
            bm = self.engine.block_manager
            return {"num_used_blocks": bm.num_used_blocks, "num_free_blocks": bm.num_free_blocks,
                    "num_requests": len(self.requests), "num_steps": self.num_steps,
                    "num_cached_tokens": self.engine.scheduler.num_cached_tokens}

    def shutdown(self) -> None:
        self._alive = False
        self._wake.set()
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

    def _grant_pinned(self, lease_id: str, block_ids: list[int]) -> KVHandle:
        """Lease full blocks this worker holds a reference on; `_free_lease` drops it when the lease ends."""
        self._pinned[lease_id] = block_ids
        bs = self.engine.block_manager.block_size
        return self.kv_exporter.grant_blocks(lease_id, block_ids, len(block_ids) * bs)

    def _loop(self) -> None:
        while self._alive:
            with self.lock:
                busy = self.engine.has_unfinished_requests()
            if not busy:
                self._idle()
                with self.lock:
                    metrics.record_load(self.role, self.worker_id, self.engine)
                self._wake.wait(IDLE_WAIT_S)
                self._wake.clear()
                continue
            try:
                with self.lock:
                    self._settle()
                    outs = self.engine.step(forward=self._forward())
                    stats = self.engine.last_step
                    metrics.record_step(self.role, self.worker_id, stats, self.engine)
                self.num_steps += 1
                self._after_step(outs, stats)
            except Exception as exc:  # noqa: BLE001 - a broken step must not kill the worker silently
                logger.exception("%s: step failed", self.worker_id)
                self._fail_all(f"{self.role} step failed: {exc!r}")

    def _fail_all(self, message: str) -> None:
        with self.lock:
            reqs = list(self.requests.values())
            for r in reqs:
                self.engine.abort(r.request_id)
            self.requests.clear()
        self._push([StreamEvent(r.request_id, r.offset, [], True, "error", message) for r in reqs], reqs)
        for r in reqs:
            self.router.on_finished.remote(self.worker_id, r.request_id)

    def _push(self, events: list[StreamEvent], reqs: list[GenRequest]) -> None:
        """One fire-and-forget call per ingress hub with all of this step's events."""
        by_hub: dict[str, list[StreamEvent]] = defaultdict(list)
        hubs: dict[str, Any] = {}
        for ev, req in zip(events, reqs):
            by_hub[req.hub_id].append(ev)
            hubs[req.hub_id] = req.hub
        for hub_id, evs in by_hub.items():
            hubs[hub_id].push.remote(evs)

    def _after_step(self, outs: list[RequestOutput], stats) -> None:
        raise NotImplementedError


@ray.remote(max_concurrency=16)
class PrefillWorker(KVExportMixin, _EngineWorker):
    """Runs prompts in prefill-only mode (batched by token budget), streams the first token at once,
    and leases the KV blocks until a decode worker pulls them."""

    role = "prefill"

    def __init__(self, worker_id: str, config: ServeConfig, router: Any):
        _EngineWorker.__init__(self, worker_id, config, router)
        self.kv_exporter = KVExporter(worker_id, self.engine, engine_lock=self.lock, lease_s=config.kv_lease_s,
                                      free=self._free_lease)
        # Requests whose KV is leased out, kept so a restarted router can rebuild its queue.
        self.leased: dict[str, tuple[GenRequest, KVHandle]] = {}
        self._start()

    def snapshot(self) -> dict:
        """What this worker holds, for a router rebuilding its state after a restart."""
        with self.lock:
            live = {rid: v for rid, v in self.leased.items() if rid in self.kv_exporter.leases}
            self.leased = live
            return {"prefilling": list(self.requests.values()), "leased": list(live.values())}

    def close(self) -> None:
        """Drained: release every lease and transfer group."""
        self.kv_exporter.close()
        self.kv_importer.close()
        self.shutdown()

    def kv_backup(self, handle: KVHandle, exporter: Any, request_id: str, token_ids: list[int], first_block: int) -> int:
        """Pull a copy of prompt KV that decode worker `exporter` computed (a local prefill, a moved
        sequence) into this worker's prefix cache: `handle` holds the full blocks `first_block`... of
        `token_ids`. If that decode worker dies, its sequence is recomputed here from the end of these
        blocks instead of from its first token. Returns the blocks newly cached (0 if the pull failed:
        the copy is only an optimization)."""
        try:
            block_ids = self.kv_importer.pull(handle, exporter)
        except KVTransferError as exc:
            logger.info("%s: KV backup of %s not taken: %r", self.worker_id, request_id, exc)
            return 0
        with self.lock:
            n = self.engine.cache_blocks(token_ids, block_ids, first_block)
        self.router.on_kv_backup.remote(self.worker_id, request_id, len(token_ids), handle.num_tokens)
        return n

    def kv_lease_prefix(self, request_id: str, token_ids: list[int], max_tokens: int) -> KVHandle | None:
        """Lease the cached blocks of the longest cached prefix of `token_ids` (at most `max_tokens`
        tokens) for a decode worker to pull: a moved sequence resumes there and recomputes only the
        rest (`DecodeWorker.resume`). Does not wait for the step under way. None if nothing is cached."""
        try:
            block_ids = self._on_blocks(lambda: self.engine.take_cached_blocks(token_ids, max_tokens))
        except TimeoutError:
            return None
        if not block_ids:
            return None
        return self._grant_pinned(f"{request_id}@kv-prefix-{next(self._lease_ids)}", block_ids)

    def add(self, req: GenRequest) -> None:
        try:
            with self.lock:
                self._forget(req.request_id)
                self.engine.add_request(req.request_id, req.prompt_token_ids, req.params, priority=req.priority,
                                        prefill_only=True, arrival_time=_engine_arrival(req),
                                        urgent=req.offset > 0)
                self.requests[req.request_id] = req
        except ValueError as exc:  # InvalidRequestError and friends: tell the client, free nothing
            self._push([StreamEvent(req.request_id, req.offset, [], True, "error", str(exc))], [req])
            self.router.on_finished.remote(self.worker_id, req.request_id)
            return
        self._wake.set()

    def _forget(self, request_id: str) -> None:
        """Drop what an earlier attempt of `request_id` left here (caller holds the lock): the router
        re-prefills a request whose transfer failed or whose decode worker died, possibly on this
        worker while the old lease (and its blocks) still lives."""
        if self.kv_exporter.leases.release(request_id):
            self.leased.pop(request_id, None)
        self.kv_exporter.free_released()
        if request_id in self.requests:
            self.requests.pop(request_id)
            self.engine.abort(request_id)

    def release_queued(self, max_tokens: int) -> list[GenRequest]:
        """Give back the newest requests whose prefill has not started, up to `max_tokens` prompt
        tokens, so the router can move them to a less loaded (e.g. just added) worker."""
        out, total = [], 0
        with self.lock:
            for r in reversed(list(self.engine.scheduler.waiting)):
                if r.num_computed_tokens or r.request_id not in self.requests:
                    continue
                if total + r.num_prompt_tokens > max_tokens:
                    break
                self.engine.abort(r.request_id)
                out.append(self.requests.pop(r.request_id))
                total += r.num_prompt_tokens
        return out

    def queued_prompt_tokens(self) -> int:
        with self.lock:
            return sum(len(r.prompt_token_ids) for r in self.requests.values())

    def _idle(self) -> None:
        self.kv_exporter.reap_expired()
        self.kv_exporter.free_released()
        with self.lock:
            if len(self.leased) > len(self.kv_exporter.leases):
                self.leased = {rid: v for rid, v in self.leased.items() if rid in self.kv_exporter.leases}

    def _after_step(self, outs: list[RequestOutput], stats) -> None:
        events, reqs = [], []
        for out in outs:
            with self.lock:
                req = self.requests.pop(out.request_id, None)
            if req is None:  # aborted while its step ran
                if out.finish_reason == "prefilled":
                    with self.lock:
                        self.engine.release_prefilled(out.request_id)
                continue
            ev = StreamEvent(req.request_id, req.offset, list(out.new_token_ids),
                             num_prompt_tokens=req.num_original_prompt_tokens,
                             num_cached_tokens=out.num_cached_tokens)
            if out.finish_reason == "prefilled":
                handle = self.kv_exporter.grant(out, out.num_prompt_tokens)
                with self.lock:
                    self.leased[req.request_id] = (req, handle)
                self.router.on_prefilled.remote(self.worker_id, req.request_id, handle)
            else:
                ev.finished, ev.finish_reason = True, out.finish_reason
                self.router.on_finished.remote(self.worker_id, req.request_id)
            events.append(ev)
            reqs.append(req)
        self._push(events, reqs)

    def kv_stats(self) -> dict:
        return {**self.kv_exporter.stats(), **self.kv_importer.stats()}


@ray.remote(max_concurrency=32)
class DecodeWorker(KVExportMixin, _EngineWorker):
    """Pulls prefilled KV, decodes in one continuous batch, reports to the router after every step.
    Colocated (no prefill pool), it prefills its requests itself (`resume`). A prompt it prefilled
    itself next to a prefill pool, it copies to a prefill worker's prefix cache (`kv_backup`)."""

    role = "decode"

    def __init__(self, worker_id: str, config: ServeConfig, router: Any):
        _EngineWorker.__init__(self, worker_id, config, router)
        self._aborted: set[str] = set()
        # KV backups: request id -> (prefill worker id, its actor, first block to copy), until the prompt
        # is computed; then the copied blocks, pinned by lease id until the prefill worker has them.
        self._backups: dict[str, tuple[str, Any, int]] = {}
        self.kv_exporter = KVExporter(worker_id, self.engine, engine_lock=self.lock, lease_s=config.kv_lease_s,
                                      free=self._free_lease)
        self._me = ray.get_runtime_context().current_actor  # the exporter a prefill worker pulls a copy from
        self.prefix_fetches = 0
        self.prefix_fetch_tokens = 0
        self._start()

    def _fail_all(self, message: str) -> None:
        with self.lock:
            self._backups.clear()  # their requests end here
        _EngineWorker._fail_all(self, message)

    def admit(self, req: GenRequest, handle: KVHandle, prefill_actor: Any) -> bool:
        """Fetch the KV from `prefill_actor` and join the running batch. False (router re-prefills) on
        any transfer failure; blocks on both sides are already freed then."""
        t0 = time.perf_counter()
        try:
            block_ids = self.kv_importer.pull(handle, prefill_actor)
        except KVTransferError as exc:
            logger.warning("%s: KV pull of %s failed: %r", self.worker_id, req.request_id, exc)
            return False
        metrics.record_kv_pull(self.worker_id, handle.nbytes, time.perf_counter() - t0)
        with self.lock:
            if req.request_id in self._aborted:
                self._aborted.discard(req.request_id)
                self.engine.free_blocks(block_ids)
                return True
            self.engine.add_prefilled_request(req.request_id, req.prompt_token_ids, [handle.first_token], req.params,
                                              block_ids, handle.num_tokens, priority=req.priority)
            self.requests[req.request_id] = req
        self._wake.set()
        return True

    def resume(self, req: GenRequest, backup: tuple[str, Any, int] | None = None,
               fetch: tuple[str, Any, int] | None = None) -> bool | str:
        """Run `req` whole here: prefill included, as chunks mixed into this worker's running batch.

        Two uses: colocated serving (no prefill pool), and taking over a sequence whose decode worker
        died (its prompt then holds every token the client already has). A moved sequence so neither
        queues behind new prompts on the prefill pool nor waits for a transfer. Returns True, or the
        engine's reason for refusing it (the router then fails it, or goes through prefill).

        `backup` = (prefill worker id, its actor, first block): once the prompt is computed, copy its
        full blocks from that one on to the prefill worker's prefix cache (`PrefillWorker.kv_backup`).

        `fetch` = (prefill worker id, its actor, tokens): that prefill worker has about the first
        `tokens` tokens of the prompt in its prefix cache (a moved sequence: its prompt, or a KV
        backup). Pull them into this worker's prefix cache first, so only the rest is recomputed here.
        It happens while both workers' steps run; if it fails, the whole prompt is computed here."""
        rid = req.request_id
        self._aborted.discard(rid)
        fetched = self._fetch_prefix(req, *fetch) if fetch is not None else []
        with self.lock:
            if fetched:
                bs = self.engine.block_manager.block_size
                self.engine.cache_blocks(req.prompt_token_ids[:len(fetched) * bs], fetched)
            if rid in self._aborted:  # aborted while its prefix was on the way
                self._aborted.discard(rid)
                return True
            try:
                self.engine.add_request(req.request_id, req.prompt_token_ids, req.params, priority=req.priority,
                                        arrival_time=_engine_arrival(req), urgent=req.offset > 0)
            except ValueError as exc:
                logger.warning("%s: cannot run %s here: %s", self.worker_id, req.request_id, exc)
                return str(exc) or type(exc).__name__
            self.requests[req.request_id] = req
            if backup is not None:
                self._backups[req.request_id] = backup
        self._wake.set()
        return True

    def _fetch_prefix(self, req: GenRequest, prefill_id: str, actor: Any, num_tokens: int) -> list[int]:
        """Pull the cached prefix of `req`'s prompt from prefill worker `actor` into new blocks here;
        their ids, or [] when it has none or the transfer failed (the prompt is then computed here)."""
        timeout_s = self.config.kv_transfer_timeout_s
        t0 = time.perf_counter()
        try:
            handle = ray.get(actor.kv_lease_prefix.remote(req.request_id, req.prompt_token_ids, num_tokens),
                             timeout=timeout_s)
            if handle is None:
                return []
            block_ids = self.kv_importer.pull(handle, actor)
        except (KVTransferError, ray.exceptions.RayError) as exc:
            logger.info("%s: prefix of %s not fetched from %s: %r", self.worker_id, req.request_id, prefill_id, exc)
            return []
        metrics.record_kv_pull(self.worker_id, handle.nbytes, time.perf_counter() - t0)
        self.prefix_fetches += 1
        self.prefix_fetch_tokens += handle.num_tokens
        return block_ids

    def abort(self, request_id: str) -> bool:
        with self.lock:
            self._backups.pop(request_id, None)
            known = request_id in self.requests
            if not known:
                self._aborted.add(request_id)  # a pull may be in flight
            return _EngineWorker.abort(self, request_id)

    def snapshot(self) -> dict:
        with self.lock:
            return {"decoding": list(self.requests.values())}

    def kv_stats(self) -> dict:
        return {**self.kv_importer.stats(), **self.kv_exporter.stats(), "prefix_fetches": self.prefix_fetches,
                "prefix_fetch_tokens": self.prefix_fetch_tokens}

    def close(self) -> None:
        self.kv_importer.close()
        self.kv_exporter.close()
        self.shutdown()

    def _idle(self) -> None:
        with self.lock:
            self._settle()

    def _start_backup(self, req: GenRequest, out: RequestOutput) -> tuple | None:
        """The prompt of `req` is computed: pin its full blocks past the ones the prefill worker has
        and lease them (caller holds the lock). Returns the `kv_backup` call's arguments, or None."""
        prefill_id, actor, first = self._backups.pop(req.request_id)
        if out.finished:
            return None
        block_ids = self.engine.pin_computed_blocks(req.request_id, len(req.prompt_token_ids), first)
        if not block_ids:
            return None
        handle = self._grant_pinned(f"{req.request_id}@kv-backup-{next(self._lease_ids)}", block_ids)
        end = (first + len(block_ids)) * self.engine.block_manager.block_size
        return actor, (handle, self._me, req.request_id, req.prompt_token_ids[:end], first)

    def report(self) -> DecodeReport:
        with self.lock:
            bm = self.engine.block_manager
            return DecodeReport(self.worker_id, bm.num_free_blocks, bm.num_blocks, self.engine.num_running,
                                self.engine.num_waiting, prefill_backlog=self.engine.prefill_backlog)

    def _after_step(self, outs: list[RequestOutput], stats) -> None:
        events, reqs, finished, backups = [], [], [], []
        with self.lock:
            for out in outs:
                req = self.requests.get(out.request_id)
                if req is None:
                    continue
                if out.request_id in self._backups:
                    backups.append(self._start_backup(req, out))
                offset = req.offset + len(out.token_ids) - len(out.new_token_ids)
                ev = StreamEvent(req.request_id, offset, list(out.new_token_ids),
                                 num_prompt_tokens=req.num_original_prompt_tokens,
                                 num_cached_tokens=out.num_cached_tokens)
                if out.finished:
                    ev.finished, ev.finish_reason = True, out.finish_reason
                    del self.requests[out.request_id]
                    finished.append(out.request_id)
                events.append(ev)
                reqs.append(req)
            report = self.report()
        self._push(events, reqs)
        for b in backups:
            if b is not None:
                b[0].kv_backup.remote(*b[1])
        report.finished_ids = finished
        report.batch_size = stats.num_seqs
        report.step_s = stats.duration_s
        report.num_preempted = stats.num_preempted
        self.router.report_decode.remote(report)
