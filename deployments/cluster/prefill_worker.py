"""The prefill worker: runs prompts in prefill-only mode and leases their KV to decode workers."""

from __future__ import annotations

import logging
import time
from typing import Any

import ray

from deployments.cluster.engine_worker import EngineWorker, engine_arrival
from deployments.cluster.kv_endpoint import KVExportMixin
from deployments.cluster.messages import GenRequest, LeasedKV, Role, StreamEvent, WorkerSnapshot
from deployments.config import ServeConfig
from engine import RequestOutput
from engine.errors import refusal_text
from kv_transfer import KVHandle, KVTransferError

logger = logging.getLogger(__name__)


class PrefillSide(KVExportMixin, EngineWorker):
    """The prefill role: runs prompts in prefill-only mode (batched by token budget), streams the first
    token at once, and leases the KV blocks until a decode worker pulls them. `PrefillWorker` is this
    alone; `RoleWorker` (role_worker.py) has it beside the decode role."""

    role = Role.PREFILL

    def __init__(self, worker_id: str, config: ServeConfig, router: Any):
        EngineWorker.__init__(self, worker_id, config, router)
        self._init_exporter()
        self._init_prefill()
        self._start()

    def _init_prefill(self) -> None:
        # Requests whose KV is leased out, kept so a restarted router can rebuild its queue.
        self.leased: dict[str, LeasedKV] = {}

    def _took_prompt(self, request_id: str) -> None:
        """`add` took `request_id` (caller holds the lock): a `RoleWorker` notes it as a prompt."""

    def _prefilling(self, request_id: str) -> bool:
        """Whether `request_id` (held here) is a prompt this role computes (a `RoleWorker` also decodes)."""
        return True

    def snapshot(self) -> WorkerSnapshot:
        """What this worker holds, for a router rebuilding its state after a restart."""
        with self.lock:
            return self._prefill_snapshot()

    def _prefill_snapshot(self) -> WorkerSnapshot:
        live = {rid: v for rid, v in self.leased.items() if rid in self.kv_exporter.leases}
        self.leased = live
        return WorkerSnapshot(prefilling=[r for rid, r in self.requests.items() if self._prefilling(rid)],
                              leased=list(live.values()))

    def close(self) -> None:
        """Drained: release every lease and transfer group."""
        self.kv_exporter.close()
        self.kv_importer.close()
        self.shutdown()

    def kv_backup(self, handle: KVHandle, exporter: Any, request_id: str, token_ids: list[int], first_block: int,
                  cache_salt: str | None = None) -> int:
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
            n = self.lending.cache_blocks(token_ids, block_ids, first_block, cache_salt=cache_salt)
        self.router.on_kv_backup.remote(self.worker_id, request_id, len(token_ids), handle.num_tokens)
        return n

    def kv_lease_prefix(self, request_id: str, token_ids: list[int], max_tokens: int,
                        cache_salt: str | None = None, peer_id: str | None = None) -> KVHandle | None:
        """Lease the cached blocks of the longest cached prefix of `token_ids` (at most `max_tokens`
        tokens) for decode worker `peer_id` to pull: a moved sequence resumes there and recomputes only
        the rest (`DecodeWorker.resume`). Does not wait for the step under way. None if nothing is cached."""
        try:
            block_ids = self._on_blocks(lambda: self.lending.take_cached_blocks(token_ids, max_tokens, cache_salt))
        except TimeoutError:
            return None
        if not block_ids:
            return None
        return self._grant_pinned(f"{request_id}@kv-prefix-{next(self._lease_ids)}", block_ids, peer=peer_id)

    def add(self, req: GenRequest) -> None:
        try:
            with self.lock:
                self._forget(req.request_id)
                if self._aborted.take(req):
                    return  # its client left while this call was on its way
                self.engine.add_request(req.request_id, req.prompt_token_ids, req.params, priority=req.priority,
                                        prefill_only=True, arrival_time=engine_arrival(req),
                                        urgent=req.offset > 0, cache_salt=req.cache_salt,
                                        num_resumed_output=req.num_resumed_output, tenant=req.tenant,
                                        tenant_weight=req.tenant_weight)
                self.requests[req.request_id] = req
                self._took_prompt(req.request_id)
                self.traces.begin("prefill", req, {"prompt_tokens": len(req.prompt_token_ids)})
        except ValueError as exc:  # InvalidRequestError and friends: tell the client, free nothing
            self._push([StreamEvent(req.request_id, req.offset, [], True, "error", refusal_text(exc))], [req])
            self.router.on_finished.remote(self.worker_id, req.request_id)
            return
        self.host.wake()

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
                if r.num_computed_tokens or r.request_id not in self.requests or not self._prefilling(r.request_id):
                    continue
                if total + r.num_prompt_tokens > max_tokens:
                    break
                self.engine.abort(r.request_id)
                out.append(self.requests.pop(r.request_id))
                total += r.num_prompt_tokens
        return out

    def queued_prompt_tokens(self) -> int:
        with self.lock:
            return sum(len(r.prompt_token_ids) for rid, r in self.requests.items() if self._prefilling(rid))

    def _idle(self) -> None:
        self.kv_exporter.reap_expired()
        self.kv_exporter.free_released()
        with self.lock:
            if len(self.leased) > len(self.kv_exporter.leases):
                self.leased = {rid: v for rid, v in self.leased.items() if rid in self.kv_exporter.leases}

    def _after_step(self, outs: list[RequestOutput], stats) -> None:
        events, reqs = [], []
        self.traces.step(self.engine.step_request_ids, stats)
        for out in outs:
            with self.lock:
                req = self.requests.pop(out.request_id, None)
            if req is None:  # aborted while its step ran
                if out.finish_reason == "prefilled":
                    with self.lock:
                        self.lending.release_prefilled(out.request_id)
                continue
            ev = StreamEvent(req.request_id, req.offset, list(out.new_token_ids),
                             num_prompt_tokens=req.num_original_prompt_tokens,
                             num_cached_tokens=out.num_cached_tokens, logprobs=out.logprobs,
                             prompt_logprobs=out.prompt_logprobs if req.offset == 0 else None)
            if out.finish_reason == "prefilled":
                handle = self.kv_exporter.grant(out, out.num_prompt_tokens)
                self.traces.child(req.request_id, "first_token", time.time_ns())
                self.traces.end(req.request_id, {"cached_tokens": out.num_cached_tokens, "lease_epoch": handle.epoch,
                                                 "kv_bytes": handle.nbytes})
                with self.lock:
                    self.leased[req.request_id] = LeasedKV(req, handle)
                self.router.on_prefilled.remote(self.worker_id, req.request_id, handle)
            else:
                ev.finished, ev.finish_reason = True, out.finish_reason
                ev.error = out.error  # finish_reason "error": what this request alone did wrong
                self.traces.end(req.request_id, {"finish_reason": out.finish_reason})
                self.router.on_finished.remote(self.worker_id, req.request_id)
            events.append(ev)
            reqs.append(req)
        self._push(events, reqs)

    def kv_stats(self) -> dict:
        return {**self.kv_exporter.stats(), **self.kv_importer.stats()}


@ray.remote(max_concurrency=16)
class PrefillWorker(PrefillSide):
    """A worker of the prefill pool (`PrefillSide`)."""

