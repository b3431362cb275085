"""The router: one Ray actor that owns the worker pools and decides where each request goes.

    submit ─▶ queue ─▶ prefill worker (least queued prompt tokens)
                         │ on_prefilled(handle)
                         ▼
              pending-decode queue ─▶ decode worker with room (after every step report)

It is off the per-token path: tokens go from workers to the ingress's StreamHub. It sees one
`DecodeReport` per decode worker per step and fills freed capacity at once, which is continuous
batching across the whole decode pool.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any

import ray

from deployments.config import ServeConfig
from deployments.messages import DecodeReport, GenRequest, StreamEvent
from deployments.workers import DecodeWorker, PrefillWorker
from kv_transfer import KVHandle

logger = logging.getLogger(__name__)

MAX_ATTEMPTS = 4


@dataclass(slots=True)
class _Tracked:
    req: GenRequest
    stage: str  # "prefill" | "pending_decode" | "admitting" | "decode"
    worker_id: str | None = None
    handle: KVHandle | None = None
    prefill_worker_id: str | None = None


@dataclass(slots=True)
class _Worker:
    worker_id: str
    role: str
    actor: Any
    info: dict = field(default_factory=dict)
    queued_prompt_tokens: int = 0  # prefill
    report: DecodeReport | None = None  # decode
    reserved_blocks: int = 0  # decode: blocks promised to admissions not yet in a report
    reserved_seqs: int = 0
    max_batch_seen: int = 0
    num_steps: int = 0


@ray.remote(num_cpus=0, max_restarts=0)
class Router:
    def __init__(self, config: ServeConfig):
        self.config = config
        self.me = ray.get_runtime_context().current_actor
        self.prefill: dict[str, _Worker] = {}
        self.decode: dict[str, _Worker] = {}
        self.tracked: dict[str, _Tracked] = {}
        self.pending_decode: list[str] = []
        self.counters = {"submitted": 0, "rejected": 0, "finished": 0, "aborted": 0, "retries": 0,
                         "transfer_failures": 0, "admitted": 0}
        self._ready = asyncio.Event()
        self._startup_error: str | None = None
        for i in range(config.num_prefill_workers):
            self._spawn("prefill", f"prefill-{i}")
        for i in range(config.num_decode_workers):
            self._spawn("decode", f"decode-{i}")
        self._startup = asyncio.get_event_loop().create_task(self._await_workers())

    # ------------------------------------------------------------------ pools
    def _spawn(self, role: str, worker_id: str) -> _Worker:
        c = self.config
        cls = PrefillWorker if role == "prefill" else DecodeWorker
        resources = c.prefill_resources if role == "prefill" else c.decode_resources
        actor = cls.options(num_cpus=c.worker_num_cpus, num_gpus=c.worker_num_gpus, resources=dict(resources) or None,
                            name=None).remote(worker_id, c, self.me)
        w = _Worker(worker_id, role, actor)
        (self.prefill if role == "prefill" else self.decode)[worker_id] = w
        return w

    async def _await_workers(self) -> None:
        try:
            workers = list(self.prefill.values()) + list(self.decode.values())
            infos = await asyncio.wait_for(asyncio.gather(*[w.actor.info.remote() for w in workers]), 900)
            for w, info in zip(workers, infos):
                w.info = info
        except Exception as exc:  # noqa: BLE001
            self._startup_error = repr(exc)
            logger.exception("workers failed to start")
        self._ready.set()

    async def wait_ready(self, timeout_s: float = 900.0) -> dict:
        """Blocks until every worker loaded its model; returns what the ingress needs to know."""
        await asyncio.wait_for(self._ready.wait(), timeout_s)
        if self._startup_error:
            raise RuntimeError(f"pdserve workers failed to start: {self._startup_error}")
        info = next(iter(self.prefill.values())).info
        return {k: info[k] for k in ("model_dir", "max_model_len", "vocab_size")}

    # ------------------------------------------------------------------ requests
    def _num_queued(self) -> int:
        return sum(1 for t in self.tracked.values() if t.stage != "decode")

    async def submit(self, req: GenRequest) -> dict:
        """Queue `req`; {"ok": False, "retry_after_s"} when the queue is full (the caller answers 429)."""
        if self._num_queued() >= self.config.max_queued_requests:
            self.counters["rejected"] += 1
            return {"ok": False, "retry_after_s": 1.0,
                    "reason": f"{self._num_queued()} requests queued (max_queued_requests)"}
        self.counters["submitted"] += 1
        req.arrival_time = req.arrival_time or time.time()
        self.tracked[req.request_id] = _Tracked(req, "prefill")
        self._place_prefill(req)
        return {"ok": True}

    def _place_prefill(self, req: GenRequest) -> None:
        w = min(self.prefill.values(), key=lambda w: w.queued_prompt_tokens)
        w.queued_prompt_tokens += len(req.prompt_token_ids)
        t = self.tracked[req.request_id]
        t.stage, t.worker_id, t.prefill_worker_id, t.handle = "prefill", w.worker_id, w.worker_id, None
        w.actor.add.remote(req)

    def _prefill_done(self, t: _Tracked) -> None:
        w = self.prefill.get(t.prefill_worker_id or "")
        if w is not None:
            w.queued_prompt_tokens = max(0, w.queued_prompt_tokens - len(t.req.prompt_token_ids))

    async def on_prefilled(self, worker_id: str, request_id: str, handle: KVHandle) -> None:
        t = self.tracked.get(request_id)
        if t is None:  # aborted meanwhile: let the prefill worker free the blocks now
            w = self.prefill.get(worker_id)
            if w is not None:
                w.actor.kv_release.remote(request_id, handle.epoch)
            return
        self._prefill_done(t)
        t.stage, t.handle, t.worker_id = "pending_decode", handle, None
        self.pending_decode.append(request_id)
        self._admit()

    async def on_finished(self, worker_id: str, request_id: str) -> None:
        t = self.tracked.pop(request_id, None)
        if t is not None:
            if t.stage == "prefill":
                self._prefill_done(t)
            self.counters["finished"] += 1

    async def report_decode(self, report: DecodeReport) -> None:
        w = self.decode.get(report.worker_id)
        if w is None:
            return
        w.report = report
        w.num_steps += 1
        w.max_batch_seen = max(w.max_batch_seen, report.batch_size)
        for rid in report.finished_ids:
            if self.tracked.pop(rid, None) is not None:
                self.counters["finished"] += 1
        self._admit()

    # ------------------------------------------------------------------ decode admission
    def _free_capacity(self, w: _Worker) -> tuple[int, int]:
        if w.report is None:
            blocks, running = w.info.get("num_blocks", 0), 0
        else:
            blocks, running = w.report.num_free_blocks, w.report.num_running + w.report.num_waiting
        return blocks - w.reserved_blocks, self.config.max_num_seqs - running - w.reserved_seqs

    def _admit(self) -> None:
        """Fill free decode capacity from the pending queue (priority, then arrival)."""
        if not self.pending_decode:
            return
        self.pending_decode.sort(key=lambda r: (self.tracked[r].req.priority, self.tracked[r].req.arrival_time)
                                 if r in self.tracked else (0, 0))
        still: list[str] = []
        for rid in self.pending_decode:
            t = self.tracked.get(rid)
            if t is None or t.stage != "pending_decode":
                continue
            bs = self.config.block_size
            # Room for the prompt plus a block of growth, so a new sequence does not preempt at once.
            need = -(-t.handle.num_tokens // bs) + 1
            best, best_free = None, -1
            for w in self.decode.values():
                free_blocks, free_seqs = self._free_capacity(w)
                if free_seqs > 0 and free_blocks >= need and free_blocks > best_free:
                    best, best_free = w, free_blocks
            if best is None:
                still.append(rid)
                continue
            best.reserved_blocks += need
            best.reserved_seqs += 1
            t.stage, t.worker_id = "admitting", best.worker_id
            self.counters["admitted"] += 1
            prefill = self.prefill.get(t.prefill_worker_id)
            ref = best.actor.admit.remote(t.req, t.handle, prefill.actor if prefill else None)
            asyncio.get_event_loop().create_task(self._admitted(rid, best, need, ref))
        self.pending_decode = still

    async def _admitted(self, rid: str, w: _Worker, need: int, ref) -> None:
        try:
            ok = await asyncio.wait_for(ref, self.config.kv_transfer_timeout_s * 2 + 5)
        except Exception as exc:  # noqa: BLE001 - a dead or stuck decode worker: re-prefill elsewhere
            logger.warning("admit of %s on %s failed: %r", rid, w.worker_id, exc)
            ok = False
        w.reserved_blocks -= need
        w.reserved_seqs -= 1
        if w.report is not None:  # until its next report, count the blocks as taken
            w.report = replace(w.report, num_free_blocks=w.report.num_free_blocks - (need - 1 if ok else 0),
                               num_running=w.report.num_running + (1 if ok else 0))
        t = self.tracked.get(rid)
        if t is None:
            return
        if ok:
            if t.stage == "admitting":
                t.stage = "decode"
        else:
            self.counters["transfer_failures"] += 1
            await self._retry(t, "KV transfer failed")
        self._admit()

    async def _retry(self, t: _Tracked, why: str) -> None:
        """Re-prefill a request (from its prompt plus every token the client already has)."""
        req = t.req
        if req.attempt + 1 >= MAX_ATTEMPTS:
            self.tracked.pop(req.request_id, None)
            req.hub.push.remote([StreamEvent(req.request_id, req.offset, [], True, "error",
                                             f"gave up after {MAX_ATTEMPTS} attempts: {why}")])
            return
        self.counters["retries"] += 1
        req.attempt += 1
        self._place_prefill(req)

    async def abort(self, request_id: str) -> None:
        t = self.tracked.pop(request_id, None)
        if t is None:
            return
        self.counters["aborted"] += 1
        if t.stage == "prefill":
            self._prefill_done(t)
            w = self.prefill.get(t.worker_id or "")
            if w is not None:
                w.actor.abort.remote(request_id)
        elif t.stage == "pending_decode":
            w = self.prefill.get(t.prefill_worker_id or "")
            if w is not None and t.handle is not None:
                w.actor.kv_release.remote(request_id, t.handle.epoch)
        else:
            w = self.decode.get(t.worker_id or "")
            if w is not None:
                w.actor.abort.remote(request_id)

    # ------------------------------------------------------------------ introspection
    async def stats(self) -> dict:
        return {
            "counters": dict(self.counters),
            "num_tracked": len(self.tracked),
            "num_pending_decode": len(self.pending_decode),
            "prefill": {w.worker_id: {"queued_prompt_tokens": w.queued_prompt_tokens} for w in self.prefill.values()},
            "decode": {w.worker_id: {"max_batch_seen": w.max_batch_seen, "num_steps": w.num_steps,
                                     "free_blocks": w.report.num_free_blocks if w.report else None,
                                     "running": w.report.num_running if w.report else 0}
                       for w in self.decode.values()},
        }

    async def workers(self) -> dict[str, Any]:
        return {w.worker_id: w.actor for w in list(self.prefill.values()) + list(self.decode.values())}

    async def check_integrity(self) -> dict:
        """Runs every worker's block-manager integrity check; returns their block use."""
        workers = list(self.prefill.values()) + list(self.decode.values())
        res = await asyncio.gather(*[w.actor.check_integrity.remote() for w in workers])
        return {w.worker_id: r for w, r in zip(workers, res)}

    async def shutdown(self) -> None:
        for w in list(self.prefill.values()) + list(self.decode.values()):
            try:
                ray.kill(w.actor)
            except Exception:  # noqa: BLE001
                pass
