"""The decode worker: pulls prefilled KV, decodes in one continuous batch, reports after every step."""

from __future__ import annotations

import logging
import time
from typing import Any, NamedTuple

import ray

from deployments import metrics, tracing
from deployments.cluster.engine_worker import EngineWorker, engine_arrival
from deployments.cluster.kv_endpoint import KVExportMixin
from deployments.cluster.messages import (Admission, BackupTo, DecodeReport, FetchFrom, GenRequest, Role, StreamEvent,
                                          WorkerSnapshot)
from deployments.config import ServeConfig
from engine import RequestOutput
from engine.errors import refusal_text
from kv_transfer import KVHandle, KVTransferError
from kv_transfer.pair_stats import cause_of

logger = logging.getLogger(__name__)

# A step whose report would tell the router nothing new (no request finished, joined or left the
# queue) is reported only when the last report is this old. NOTE: a report per step was one Ray call
# per token at low concurrency, on the same cores the engine needs (~2 core-ms per token in the router
# alone on a 2-core host); what changes between steps otherwise is a few KV blocks, which the
# router's reservations already cover.
REPORT_EVERY_S = 0.25


class _Backup(NamedTuple):
    """A `PrefillWorker.kv_backup` call to make once this step's events are pushed."""

    target: BackupTo
    handle: KVHandle  # the pinned blocks' lease
    request_id: str
    token_ids: list[int]  # the prompt, up to the end of the copied blocks
    cache_salt: str | None = None


class DecodeSide(KVExportMixin, EngineWorker):
    """The decode role: pulls prefilled KV, decodes in one continuous batch, reports to the router
    after every step. Colocated (no prefill pool), it prefills its requests itself (`resume`). A prompt
    it prefilled itself next to a prefill pool, it copies to a prefill worker's prefix cache
    (`kv_backup`). `DecodeWorker` is this alone; `RoleWorker` (role_worker.py) has it beside the
    prefill role."""

    role = Role.DECODE

    def __init__(self, worker_id: str, config: ServeConfig, router: Any):
        EngineWorker.__init__(self, worker_id, config, router)
        self._init_exporter()
        self._init_decode()
        self._start()

    def _init_decode(self) -> None:
        # KV backups: request id -> where to copy its prompt, until the prompt is computed; then the
        # copied blocks, pinned by lease id until the prefill worker has them.
        self._backups: dict[str, BackupTo] = {}
        self._me = ray.get_runtime_context().current_actor  # the exporter a prefill worker pulls a copy from
        self.prefix_fetches = 0
        self.prefix_fetch_tokens = 0
        self._backup_calls: list[tuple[Any, KVHandle]] = []  # `kv_backup` calls made, not yet seen to end
        self._reported = (0.0, -1, -1)  # (when, running, waiting) of the last report sent
        self._pairs_reported = 0  # the version of its KV pairs' book the router last got
        self._since_report = (0, 0)  # (largest batch, preemptions) of the steps not reported yet
        self._num_reports = 0  # reports taken (`report`); an admission answers with it (`_taken`)

    def _fail_all(self, message: str, only: list[str] | None = None) -> None:
        with self.lock:  # their requests end here
            for rid in list(self._backups) if only is None else only:
                self._backups.pop(rid, None)
        EngineWorker._fail_all(self, message, only)

    def admit(self, req: GenRequest, handle: KVHandle, prefill_actor: Any) -> Admission:
        """Fetch the KV from `prefill_actor` and join the running batch. Refused (the router re-prefills)
        on any transfer failure; blocks on both sides are already freed then."""
        t0 = time.perf_counter()
        adm = tracing.start("decode.admission", req.trace, {"worker": self.worker_id, "attempt": req.attempt})
        t_pull = time.time_ns()
        try:
            block_ids = self.kv_importer.pull(handle, prefill_actor)
        except KVTransferError as exc:
            logger.warning("%s: KV pull of %s failed: %r", self.worker_id, req.request_id, exc)
            if adm is not None:
                self._trace_transfer(adm, t_pull, handle, exc)
                tracing.end(adm, {"accepted": False, "reason": f"KV pull failed: {type(exc).__name__}"})
            with self.lock:
                self._aborted.take(req)  # its call is over
            return Admission(False, f"KV pull failed: {exc!r}", retry=True)
        metrics.record_kv_pull(self.worker_id, handle.nbytes, time.perf_counter() - t0)
        if adm is not None:
            self._trace_transfer(adm, t_pull, handle)
        if adm is None:
            return self._admit_pulled(req, handle, block_ids)
        ans = self._admit_pulled(req, handle, block_ids)
        tracing.end(adm, {"accepted": ans.accepted, "reason": ans.reason or None})
        return ans

    def _trace_transfer(self, parent: Any, start_ns: int, handle: KVHandle, exc: BaseException | None = None) -> None:
        """The `kv.transfer` span of a pull that began at `start_ns` (cluster/traces.py)."""
        seconds = max(time.time_ns() - start_ns, 1) / 1e9
        kind = self.kv_importer.transport.kind_of(handle.worker_id)
        tracing.record("kv.transfer", parent, start_ns, attributes={
            "src": handle.worker_id, "dst": self.worker_id, "bytes": handle.nbytes, "blocks": handle.num_blocks,
            "lease_epoch": handle.epoch, "transport": kind.value if kind is not None else None,
            "gbps": None if exc is not None else round(handle.nbytes / seconds / 1e9, 4),
            "error": None if exc is None else type(exc).__name__,
            "failure_cause": None if exc is None else cause_of(exc).value})

    def _admit_pulled(self, req: GenRequest, handle: KVHandle, block_ids: list[int]) -> Admission:
        with self.lock:
            if self._aborted.take(req) or ray.get_runtime_context().is_canceled():  # the router gave up on it
                self.lending.free_blocks(block_ids)
                return self._taken()
            try:
                self.lending.add_prefilled_request(req.request_id, req.prompt_token_ids, [handle.first_token],
                                                  req.params, block_ids, handle.num_tokens, priority=req.priority,
                                                  cache_salt=req.cache_salt, num_resumed_output=req.num_resumed_output,
                                                  tenant=req.tenant, tenant_weight=req.tenant_weight)
            except ValueError as exc:  # the engine refuses it: it cannot start anywhere (fails at once)
                self.lending.free_blocks(block_ids)
                return Admission(False, refusal_text(exc))
            self.requests[req.request_id] = req
            self.traces.begin("decode", req, {"prompt_tokens": len(req.prompt_token_ids)})
            ans = self._taken()
        self.host.wake()
        return ans

    def resume(self, req: GenRequest, backup: BackupTo | None = None, fetch: FetchFrom | None = None) -> Admission:
        """Run `req` whole here: prefill included, as chunks mixed into this worker's running batch.

        Two uses: colocated serving (no prefill pool), and taking over a sequence whose decode worker
        died (its prompt then holds every token the client already has). A moved sequence so neither
        queues behind new prompts on the prefill pool nor waits for a transfer. Accepted, or refused
        with the engine's reason (the router then fails it, or goes through prefill).

        `backup`: once the prompt is computed, copy its full blocks from `first_block` on to that
        prefill worker's prefix cache (`PrefillWorker.kv_backup`).

        `fetch`: that prefill worker has about the first `num_tokens` tokens of the prompt in its
        prefix cache (a moved sequence: its prompt, or a KV backup). Pull them into this worker's
        prefix cache first, so only the rest is recomputed here.
        It happens while both workers' steps run; if it fails, the whole prompt is computed here."""
        t0 = time.time_ns()
        fetched = self._fetch_prefix(req, fetch) if fetch is not None else []
        with self.lock:
            if fetched:
                bs = self.engine.block_manager.block_size
                self.lending.cache_blocks(req.prompt_token_ids[:len(fetched) * bs], fetched, cache_salt=req.cache_salt)
            if self._aborted.take(req) or ray.get_runtime_context().is_canceled():  # while its prefix came
                return self._taken()
            try:
                self.engine.add_request(req.request_id, req.prompt_token_ids, req.params, priority=req.priority,
                                        arrival_time=engine_arrival(req), urgent=req.offset > 0,
                                        cache_salt=req.cache_salt, num_resumed_output=req.num_resumed_output,
                                        tenant=req.tenant, tenant_weight=req.tenant_weight)
            except ValueError as exc:
                logger.warning("%s: cannot run %s here: %s", self.worker_id, req.request_id, exc)
                return Admission(False, refusal_text(exc))
            self.requests[req.request_id] = req
            if req.trace is not None:
                tracing.record("resume", req.trace, t0, attributes={
                    "worker": self.worker_id, "attempt": req.attempt, "offset": req.offset, "moved": req.offset > 0,
                    "prompt_tokens": len(req.prompt_token_ids), "fetched_blocks": len(fetched),
                    "fetched_from": fetch.worker_id if fetch is not None else None})
                self.traces.begin("decode", req, {"prompt_tokens": len(req.prompt_token_ids), "offset": req.offset})
            if backup is not None:
                self._backups[req.request_id] = backup
            ans = self._taken()
        self.host.wake()
        return ans

    def _taken(self) -> Admission:
        """The answer to an admission taken (or dropped: aborted on its way) just now, under the lock:
        the reports taken from now on count it, the ones before do not (`DecodeReport.seq`)."""
        return Admission(True, report_seq=self._num_reports)

    def _fetch_prefix(self, req: GenRequest, src: FetchFrom) -> list[int]:
        """Pull the cached prefix of `req`'s prompt from prefill worker `src` into new blocks here;
        their ids, or [] when it has none or the transfer failed (the prompt is then computed here)."""
        timeout_s = self.config.kv_transfer_timeout_s
        t0 = time.perf_counter()
        try:
            handle = ray.get(src.actor.kv_lease_prefix.remote(req.request_id, req.prompt_token_ids, src.num_tokens,
                                                              req.cache_salt, self.worker_id),
                             timeout=timeout_s)
            if handle is None:
                return []
            block_ids = self.kv_importer.pull(handle, src.actor)
        except (KVTransferError, ray.exceptions.RayError) as exc:
            logger.info("%s: prefix of %s not fetched from %s: %r", self.worker_id, req.request_id, src.worker_id, exc)
            return []
        metrics.record_kv_pull(self.worker_id, handle.nbytes, time.perf_counter() - t0)
        self.prefix_fetches += 1
        self.prefix_fetch_tokens += handle.num_tokens
        return block_ids

    def abort(self, request_id: str, attempt: int | None = None, in_flight: bool = False) -> bool:
        """`EngineWorker.abort`; one not here yet whose `admit` / `resume` is `in_flight` (a KV pull or
        prefix fetch under way) is dropped when it gets here."""
        with self.lock:
            req = self.requests.get(request_id)
            if req is not None and attempt is not None and req.attempt != attempt:
                return False  # a newer attempt runs here: the abort was for one the router gave up on
            self._backups.pop(request_id, None)
            self.traces.end(request_id, {"finish_reason": "abort"})
            return EngineWorker.abort(self, request_id, attempt, in_flight)

    def snapshot(self) -> WorkerSnapshot:
        """What this worker holds, for a router rebuilding its state after a restart."""
        with self.lock:
            return WorkerSnapshot(decoding=list(self.requests.values()))

    def kv_stats(self) -> dict:
        return {**self.kv_importer.stats(), **self.kv_exporter.stats(), "prefix_fetches": self.prefix_fetches,
                "prefix_fetch_tokens": self.prefix_fetch_tokens}

    def close(self) -> None:
        self.kv_importer.close()
        self.kv_exporter.close()
        self.shutdown()

    def _refresh_pair_gauges(self) -> None:
        pairs = self.kv_importer.pairs
        if pairs.version:
            pairs.listener.refresh(pairs.pairs)  # copies made only when the gauges are due

    def _idle(self) -> None:
        self._refresh_pair_gauges()
        with self.lock:
            self._settle()
            pairs = self.kv_importer.pairs
            report = self.report() if pairs.version != self._pairs_reported else None
        self._reap_backup_calls()
        if report is not None:
            # NOTE: a pull failed (or a channel opened) and no step followed: pulls that keep failing
            # leave this worker idle, and that is when the router's view of its pairs matters most.
            self._pairs_reported, report.kv_pairs = pairs.version, pairs.snapshot()
            report.num_steps = self.num_steps
            self.router.report_decode.remote(report)

    def _reap_backup_calls(self) -> None:
        """A `kv_backup` call that ended without pulling its copy (its prefill worker died before the
        router could tell us) ends the copy's lease: its blocks are freed now, not at expiry."""
        calls = self._backup_calls
        if not calls:
            return
        done, _ = ray.wait([ref for ref, _ in calls], num_returns=len(calls), timeout=0)
        if not done:
            return
        done = set(done)
        self._backup_calls = [(ref, h) for ref, h in calls if ref not in done]
        for ref, handle in calls:
            if ref in done:
                try:
                    ray.get(ref, timeout=0)
                except Exception:  # noqa: BLE001 - the target is gone: nobody will pull the copy
                    self.kv_exporter.release(handle.request_id, handle.epoch)

    def _start_backup(self, req: GenRequest, out: RequestOutput) -> _Backup | None:
        """The prompt of `req` is computed: pin its full blocks past the ones the prefill worker has
        and lease them (caller holds the lock). Returns the `kv_backup` call to make, or None."""
        target = self._backups.pop(req.request_id)
        if out.finished:
            return None
        block_ids = self.lending.pin_computed_blocks(req.request_id, len(req.prompt_token_ids), target.first_block)
        if not block_ids:
            return None
        handle = self._grant_pinned(f"{req.request_id}@kv-backup-{next(self._lease_ids)}", block_ids,
                                    peer=target.worker_id)
        end = (target.first_block + len(block_ids)) * self.engine.block_manager.block_size
        return _Backup(target, handle, req.request_id, req.prompt_token_ids[:end], req.cache_salt)

    def report(self) -> DecodeReport:
        """What the router needs for admission, now; numbered (`seq`), so that the router can tell
        which admissions it counts and skip one that arrives after a newer one."""
        with self.lock:
            bm = self.engine.block_manager
            self._num_reports += 1
            return DecodeReport(self.worker_id, bm.num_free_blocks, bm.num_blocks, self.engine.num_running,
                                self.engine.num_waiting, prefill_backlog=self.engine.prefill_backlog,
                                spec=self.engine.spec_stats() if self.engine.speculator is not None else None,
                                seq=self._num_reports)

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
                                 num_cached_tokens=out.num_cached_tokens, logprobs=out.logprobs,
                                 prompt_logprobs=out.prompt_logprobs if req.offset == 0 else None)
                if out.finished:
                    ev.finished, ev.finish_reason = True, out.finish_reason
                    ev.error = out.error  # finish_reason "error": what this request alone did wrong
                    self.traces.end(out.request_id, {"finish_reason": out.finish_reason,
                                                     "output_tokens": len(out.token_ids)})
                    del self.requests[out.request_id]
                    finished.append(out.request_id)
                events.append(ev)
                reqs.append(req)
            report = self.report()
        self._push(events, reqs)
        for b in backups:
            if b is not None:
                ref = b.target.actor.kv_backup.remote(b.handle, self._me, b.request_id, b.token_ids,
                                                      b.target.first_block, b.cache_salt)
                self._backup_calls.append((ref, b.handle))
        self._reap_backup_calls()
        self._refresh_pair_gauges()
        batch, preempted = self._since_report
        batch, preempted = max(batch, stats.num_seqs), preempted + stats.num_preempted
        now = time.monotonic()
        when, running, waiting = self._reported
        if not finished and (report.num_running, report.num_waiting) == (running, waiting) \
                and now - when < REPORT_EVERY_S:
            self._since_report = (batch, preempted)
            return
        self._reported, self._since_report = (now, report.num_running, report.num_waiting), (0, 0)
        report.finished_ids = finished
        report.batch_size = batch
        report.step_s = stats.duration_s
        report.num_preempted = preempted
        report.num_steps = self.num_steps
        pairs = self.kv_importer.pairs
        if pairs.version != self._pairs_reported:
            self._pairs_reported, report.kv_pairs = pairs.version, pairs.snapshot()
        self.router.report_decode.remote(report)


@ray.remote(max_concurrency=32)
class DecodeWorker(DecodeSide):
    """A worker of the decode pool (`DecodeSide`)."""
