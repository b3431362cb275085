"""The router: one Ray actor that owns the worker pools and decides where each request goes.

    submit ─▶ prefill worker (least prompt tokens to compute: its queue + the uncached part)
                 │ on_prefilled(KVHandle)
                 ▼
    pending-decode queue ─▶ decode worker with room (after every step report)

Colocated (num_prefill_workers=0), submit puts requests straight in the pending-decode queue and the
decode worker runs them whole (`DecodeWorker.resume`), chunked prefill mixed into its batch.

It is off the per-token path: tokens go from workers to the ingress's StreamHub. It sees one
`DecodeReport` per decode worker per step and fills freed capacity at once, which is continuous
batching across the whole decode pool. It also scales each pool by its queue depth, drains workers
before removing them, and moves the requests of a dead worker elsewhere. A prompt a decode worker
computes itself (local prefill, moved sequence) it has copied to a prefill worker's prefix cache
(`kv_backup`: `DecodeWorker.resume` -> `PrefillWorker.kv_backup` -> `on_kv_backup`), so that a move
after that decode worker dies recomputes only the tokens generated since: on that prefill worker, or
on a surviving decode worker that pulls the cached prompt from it first (`kv_prefix_fetch`:
`DecodeWorker.resume(fetch=...)` -> `PrefillWorker.kv_lease_prefix`, during that worker's step; see
`_place_moved`). Workers are detached named
actors, so a restarted router adopts them and rebuilds its state from their snapshots.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

import ray

from deployments import metrics
from deployments.config import ServeConfig
from deployments.cluster.messages import DecodeReport, GenRequest, StreamEvent
from deployments.cluster.prefix_index import PrefixIndex, block_hashes
from deployments.cluster.workers import DecodeWorker, PrefillWorker
from engine import SamplingParams
from kv_transfer import KVHandle

logger = logging.getLogger(__name__)

MAX_ATTEMPTS = 6
_FETCH = object()  # `_requeue`: ask the client's hub for its delivered tokens
REPLACE_WAIT_S = 10.0  # longest a dead decode worker's replacement waits for its moved sequences
# Conditional disaggregation: a decode worker's queued prompt tokens count this many times against a
# prefill worker's, since it also has to keep decoding its running sequences.
LOCAL_PREFILL_COST = 2.0
WORKER_PREFIX = "pdserve-"
# Colocated cache-aware placement: a decode worker holding a prompt's prefix gets it while it runs at
# most this many more sequences than the least loaded worker with room.
AFFINITY_SLACK_SEQS = 4


@dataclass(slots=True)
class _Tracked:
    req: GenRequest
    params: SamplingParams  # as the client asked; a migrated request's req.params are shortened
    stage: str  # "unplaced" | "prefill" | "pending_decode" | "admitting" | "decode"
    worker_id: str | None = None
    handle: KVHandle | None = None
    prefill_worker_id: str | None = None
    queued_tokens: int = 0  # what it added to its prefill worker's queue: its prompt less the cached part
    hashes: list[int] | None = None  # its prompt's block hashes (prefix-aware placement), computed once
    hashes_of: GenRequest | None = None  # ... for this req (a requeue replaces req and its prompt)


@dataclass(slots=True)
class _Worker:
    worker_id: str
    role: str
    actor: Any
    info: dict = field(default_factory=dict)
    ready: bool = False
    draining: bool = False
    created_at: float = field(default_factory=time.time)
    ready_at: float | None = None
    queued_prompt_tokens: int = 0  # prefill
    report: DecodeReport | None = None  # decode
    reserved_blocks: int = 0  # decode: blocks promised to admissions not yet in a report
    reserved_seqs: int = 0
    reserved_prefill_tokens: int = 0  # decode: prompt tokens handed over to run here, not yet reported
    max_batch_seen: int = 0
    num_steps: int = 0


@dataclass(slots=True)
class _Moves:
    """One dead decode worker's sequences, being placed one by one (`Router._place_moved`)."""
    tokens: dict[str, int] = field(default_factory=dict)  # recompute tokens given to each destination
    ids: set[str] = field(default_factory=set)  # the requests placed so far


@dataclass(slots=True)
class _ScaleState:
    desired: int = 0
    reason: str = ""
    signal_since: float | None = None
    signal_dir: int = 0


class Router:
    def __init__(self, config: ServeConfig):
        self.config = config
        self.me = ray.get_runtime_context().current_actor
        self.namespace = ray.get_runtime_context().namespace
        self.pools: dict[str, dict[str, _Worker]] = {"prefill": {}, "decode": {}}
        self.tracked: dict[str, _Tracked] = {}
        self.pending_decode: list[str] = []
        self.unplaced: list[str] = []
        self.counters = {"submitted": 0, "rejected": 0, "finished": 0, "aborted": 0, "retries": 0,
                         "migrations": 0, "transfer_failures": 0, "admitted": 0, "worker_deaths": 0,
                         "scale_ups": 0, "scale_downs": 0, "adopted_requests": 0, "failed": 0, "rebalanced": 0,
                         "local_prefills": 0, "prefix_routed": 0, "prefix_routed_tokens": 0,
                         "kv_backups": 0, "kv_backup_tokens": 0, "prefix_fetches": 0}
        self.scale = {"prefill": _ScaleState(), "decode": _ScaleState()}
        self._replacing = {"prefill": 0, "decode": 0}  # dead workers whose replacement is pending
        self.decisions: deque[dict] = deque(maxlen=100)
        self.moves: deque[dict] = deque(maxlen=100)  # where dead decode workers' sequences went
        # Which prompt blocks each worker computed lately: where a prompt's prefix is likely cached.
        self.prefix_index = PrefixIndex(config.engine.block_size)
        self._next_id = {"prefill": 0, "decode": 0}
        self._ready = asyncio.Event()
        self._startup_error: str | None = None
        self._tasks = [asyncio.get_event_loop().create_task(self._start())]

    @property
    def prefill(self) -> dict[str, _Worker]:
        return self.pools["prefill"]

    @property
    def decode(self) -> dict[str, _Worker]:
        return self.pools["decode"]

    # ------------------------------------------------------------------ startup / adoption
    async def _start(self) -> None:
        try:
            adopted = await self._adopt_existing()
            for pool in ("prefill", "decode"):
                for _ in range(getattr(self.config, f"num_{pool}_workers") - len(self.pools[pool])):
                    self._spawn(pool)
            await asyncio.wait_for(asyncio.gather(*[self._until_ready(w) for p in self.pools.values()
                                                    for w in list(p.values())]), 900)
            if adopted:
                await self._rebuild()
        except Exception as exc:  # noqa: BLE001
            self._startup_error = repr(exc)
            logger.exception("router startup failed")
        self._ready.set()
        loop = asyncio.get_event_loop()
        self._tasks += [loop.create_task(self._monitor()), loop.create_task(self._autoscale())]

    async def _adopt_existing(self) -> bool:
        """A restarted router finds the workers its predecessor left (they are detached)."""
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a.get("namespace") == self.namespace and a["name"].startswith(WORKER_PREFIX)]
        for name in names:
            role, idx = name.removeprefix(WORKER_PREFIX).rsplit("-", 1)
            if role not in self.pools:
                continue
            try:
                actor = ray.get_actor(name, namespace=self.namespace)
            except ValueError:
                continue
            self.pools[role][name] = _Worker(name, role, actor)
            self._next_id[role] = max(self._next_id[role], int(idx) + 1)
        return bool(names)

    async def _rebuild(self) -> None:
        snaps = {}
        for pool in self.pools.values():
            for w in pool.values():
                try:
                    snaps[w.worker_id] = await asyncio.wait_for(w.actor.snapshot.remote(), 30)
                except Exception:  # noqa: BLE001 - it died meanwhile; the monitor will notice
                    continue
        for wid, snap in snaps.items():
            for req in snap.get("decoding", []):
                self.tracked[req.request_id] = _Tracked(req, req.params, "decode", worker_id=wid)
        for wid, snap in snaps.items():
            for req in snap.get("prefilling", []):
                if req.request_id not in self.tracked:
                    self.tracked[req.request_id] = _Tracked(req, req.params, "prefill", worker_id=wid,
                                                            prefill_worker_id=wid,
                                                            queued_tokens=len(req.prompt_token_ids))
                    self.prefill[wid].queued_prompt_tokens += len(req.prompt_token_ids)
            for req, handle in snap.get("leased", []):
                if req.request_id not in self.tracked:
                    self.tracked[req.request_id] = _Tracked(req, req.params, "pending_decode", handle=handle,
                                                            prefill_worker_id=wid)
                    self.pending_decode.append(req.request_id)
        self.counters["adopted_requests"] += len(self.tracked)
        self._admit()

    def _spawn(self, role: str) -> _Worker:
        c = self.config
        wid = f"{WORKER_PREFIX}{role}-{self._next_id[role]}"
        self._next_id[role] += 1
        cls = PrefillWorker if role == "prefill" else DecodeWorker
        resources = c.prefill_resources if role == "prefill" else c.decode_resources
        actor = cls.options(name=wid, namespace=self.namespace, lifetime="detached", num_cpus=c.worker_num_cpus,
                            num_gpus=c.worker_num_gpus, resources=dict(resources) or None).remote(wid, c, self.me)
        w = _Worker(wid, role, actor)
        self.pools[role][wid] = w
        return w

    async def _until_ready(self, w: _Worker) -> None:
        w.info = await w.actor.info.remote()
        if self.config.routes_by_prefix:
            self.prefix_index.add_worker(w.worker_id, w.info.get("num_blocks", 0))
        await self._open_kv_channels(w)
        w.ready, w.ready_at = True, time.time()
        asyncio.get_event_loop().create_task(self._watch(w))
        self._flush_unplaced()
        self._admit()

    async def _open_kv_channels(self, w: _Worker) -> None:
        """Before a worker takes work, open its KV channels to the other pool's ready workers: otherwise
        the first sequence handed over between a new pair waits for the rendezvous, a stall its client
        sees (measured at seconds on a busy 2-core node, right when a replacement joins)."""
        if w.role == "decode":
            pairs = [(w, p) for p in self.prefill.values() if p.ready]
        else:
            pairs = [(d, w) for d in self.decode.values() if d.ready]
        if not pairs:
            return
        calls = [d.actor.connect_kv.remote(p.worker_id, p.actor) for d, p in pairs]
        if self.config.backs_up_kv:  # the other way: prefill workers pull copies of local prefills
            calls += [p.actor.connect_kv.remote(d.worker_id, d.actor) for d, p in pairs]
        try:
            await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True),
                                   self.config.kv_transfer_timeout_s)
        except asyncio.TimeoutError:
            logger.warning("opening KV channels for %s timed out; the first pulls will open them", w.worker_id)

    async def _watch(self, w: _Worker) -> None:
        """Notice a worker's death the moment Ray does (a call in flight on it fails), not at the next
        ping: the sooner its sequences move, the shorter the stall their clients see."""
        while self.pools[w.role].get(w.worker_id) is w:
            try:
                if await w.actor.watch.remote(300.0):
                    return  # closed after a drain
            except ray.exceptions.RayActorError as exc:
                if self.pools[w.role].get(w.worker_id) is w:
                    await self._on_worker_dead(w, repr(exc))
                return
            except Exception:  # noqa: BLE001 - e.g. a transient RPC error: the pings still watch it
                await asyncio.sleep(1.0)

    async def wait_ready(self, timeout_s: float = 900.0) -> dict:
        """Blocks until the first workers loaded their model; returns what the ingress needs to know."""
        await asyncio.wait_for(self._ready.wait(), timeout_s)
        if self._startup_error:
            raise RuntimeError(f"pdserve workers failed to start: {self._startup_error}")
        info = next(w.info for p in self.pools.values() for w in p.values() if w.ready)
        return {k: info[k] for k in ("model_dir", "max_model_len", "vocab_size")}

    # ------------------------------------------------------------------ requests
    def _num_queued(self) -> int:
        return sum(1 for t in self.tracked.values() if t.stage != "decode")

    async def submit(self, req: GenRequest) -> dict:
        """Queue `req`; {"ok": False, "retry_after_s"} when the queue is full (the caller answers 429)."""
        if self._num_queued() >= self.config.max_queued_requests:
            self.counters["rejected"] += 1
            metrics.count_rejected()
            return {"ok": False, "retry_after_s": 1.0,
                    "reason": f"{self._num_queued()} requests queued (max_queued_requests)"}
        self.counters["submitted"] += 1
        metrics.count_submitted()
        req.arrival_time = req.arrival_time or time.time()
        self.tracked[req.request_id] = _Tracked(req, req.params, "unplaced")
        self._place_prefill(req.request_id)
        return {"ok": True}

    def _place_prefill(self, rid: str, allow_local: bool = True) -> None:
        t = self.tracked[rid]
        if self.config.colocated:
            self._queue_whole(t)
            return
        candidates = [w for w in self.prefill.values() if w.ready and not w.draining]
        if not candidates:
            t.stage = "unplaced"
            if rid not in self.unplaced:
                self.unplaced.append(rid)
            return
        # Cache-aware: the worker that gets through its queue and this prompt's uncached part first.
        n = len(t.req.prompt_token_ids)
        hashes = self._hashes(t)
        cost, cached, w = min(((w.queued_prompt_tokens + n - c, -c, w) for w in candidates
                               for c in [self._cached(w, hashes, n)]), key=lambda o: o[:2])
        if allow_local and self._prefill_locally(t, cost):
            return
        self._send_to_prefill(t, w, -cached)

    def _hashes(self, t: _Tracked) -> list[int]:
        if not self.config.routes_by_prefix:
            return []
        if t.hashes is None or t.hashes_of is not t.req:  # NOTE: colocated, `_admit` asks at every report
            t.hashes, t.hashes_of = block_hashes(t.req.prompt_token_ids, self.config.engine.block_size), t.req
        return t.hashes

    def _cached(self, w: _Worker, hashes: list[int], num_tokens: int) -> int:
        """Prompt tokens `w` likely has in its prefix cache (0 without prefix-aware routing)."""
        return self.prefix_index.cached_tokens(w.worker_id, hashes, num_tokens) if hashes else 0

    def _computes(self, t: _Tracked, w: _Worker, cached: int) -> None:
        """`w` is about to compute `t`'s prompt: its blocks will be in `w`'s prefix cache."""
        if cached:
            self.counters["prefix_routed"] += 1
            self.counters["prefix_routed_tokens"] += cached
        self.prefix_index.record(w.worker_id, self._hashes(t))

    def _send_to_prefill(self, t: _Tracked, w: _Worker, cached: int = 0) -> None:
        t.queued_tokens = len(t.req.prompt_token_ids) - cached
        w.queued_prompt_tokens += t.queued_tokens
        t.stage, t.worker_id, t.prefill_worker_id, t.handle = "prefill", w.worker_id, w.worker_id, None
        self._computes(t, w, cached)
        w.actor.add.remote(t.req)

    def _prefill_backlog(self, w: _Worker) -> int:
        return (w.report.prefill_backlog if w.report is not None else 0) + w.reserved_prefill_tokens

    def _prefill_locally(self, t: _Tracked, prefill_cost: int) -> bool:
        """Conditional disaggregation: run a short prompt whole on a decode worker (chunked prefill
        mixed into its batch, no KV transfer) when the prefill pool is the bottleneck, i.e. when that
        decode worker would get through it sooner than the best prefill worker, which has
        `prefill_cost` tokens to compute first (its queue and this prompt's uncached part). Without
        it, a busy prefill pool leaves the decode pool idle."""
        n = len(t.req.prompt_token_ids)
        if n > self.config.local_prefill_max_tokens:
            return False
        need = self._blocks_needed(n)
        hashes = self._hashes(t)
        best, best_cost, best_cached = None, 0, 0
        for w in self.decode.values():
            if not w.ready or w.draining:
                continue
            free_blocks, free_seqs = self._free_capacity(w)
            cached = self._cached(w, hashes, n)
            cost = self._prefill_backlog(w) + n - cached
            if free_seqs > 0 and free_blocks >= need and (best is None or cost < best_cost):
                best, best_cost, best_cached = w, cost, cached
        if best is None or LOCAL_PREFILL_COST * best_cost >= prefill_cost:
            return False
        self.counters["local_prefills"] += 1
        self._run_whole(t, best, need, best_cached)
        return True

    def _queue_whole(self, t: _Tracked) -> None:
        """Colocated: wait for a decode worker with room, which then runs the request whole."""
        t.stage, t.handle, t.worker_id, t.prefill_worker_id = "pending_decode", None, None, None
        if t.req.request_id not in self.pending_decode:
            self.pending_decode.append(t.req.request_id)
        self._admit()

    def _flush_unplaced(self) -> None:
        rids, self.unplaced = self.unplaced, []
        for rid in rids:
            if rid in self.tracked:
                self._place_prefill(rid)

    def _prefill_done(self, t: _Tracked) -> None:
        w = self.prefill.get(t.prefill_worker_id or "")
        if w is not None:
            w.queued_prompt_tokens = max(0, w.queued_prompt_tokens - t.queued_tokens)
        t.queued_tokens = 0

    async def on_prefilled(self, worker_id: str, request_id: str, handle: KVHandle) -> None:
        t = self.tracked.get(request_id)
        if t is None or t.stage != "prefill" or t.prefill_worker_id != worker_id:
            w = self.prefill.get(worker_id)  # aborted or moved meanwhile: free the blocks now
            if w is not None:
                w.actor.kv_release.remote(request_id, handle.epoch)
            return
        self._prefill_done(t)
        t.stage, t.handle, t.worker_id = "pending_decode", handle, None
        self.pending_decode.append(request_id)
        self._admit()

    async def on_finished(self, worker_id: str, request_id: str) -> None:
        t = self.tracked.get(request_id)
        if t is not None and t.worker_id == worker_id:
            del self.tracked[request_id]
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
            t = self.tracked.get(rid)
            if t is not None and t.worker_id == report.worker_id:
                del self.tracked[rid]
                self.counters["finished"] += 1
        self._admit()

    # ------------------------------------------------------------------ decode admission
    def _free_capacity(self, w: _Worker) -> tuple[int, int]:
        if w.report is None:
            blocks, running = w.info.get("num_blocks", 0), 0
        else:
            blocks, running = w.report.num_free_blocks, w.report.num_running + w.report.num_waiting
        return blocks - w.reserved_blocks, self.config.engine.max_num_seqs - running - w.reserved_seqs

    def _blocks_needed(self, num_tokens: int) -> int:
        """Blocks to reserve for a sequence joining a decode worker: its tokens plus one block of growth,
        so that it does not preempt at once."""
        return -(-num_tokens // self.config.engine.block_size) + 1

    def _pick_decode(self, need: int) -> _Worker | None:
        """The ready decode worker with the most free blocks, if it has `need` blocks and a slot."""
        best, best_free = None, -1
        for w in self.decode.values():
            if not w.ready or w.draining:
                continue
            free_blocks, free_seqs = self._free_capacity(w)
            if free_seqs > 0 and free_blocks >= need and free_blocks > best_free:
                best, best_free = w, free_blocks
        return best

    def _pick_whole(self, t: _Tracked, need: int) -> tuple[_Worker | None, int]:
        """Colocated: the decode worker to run `t` whole, and the prompt tokens it likely has cached. The worker with the longest cached prefix, unless it holds more than
        AFFINITY_SLACK_SEQS sequences above the least loaded one with room (then load wins: the most
        free blocks, as without a cache)."""
        best = self._pick_decode(need)
        hashes = self._hashes(t)
        if best is None or not hashes:
            return best, 0
        n = len(t.req.prompt_token_ids)
        room = []
        for w in self.decode.values():
            if w.ready and not w.draining:
                free_blocks, free_seqs = self._free_capacity(w)
                if free_seqs > 0 and free_blocks >= need:
                    room.append((w, self.config.engine.max_num_seqs - free_seqs, self._cached(w, hashes, n)))
        least = min(load for _, load, _ in room)
        near = [(cached, w) for w, load, cached in room if load <= least + AFFINITY_SLACK_SEQS and cached]
        if near:
            cached, w = max(near, key=lambda o: o[0])
            return w, cached
        return best, self._cached(best, hashes, n)

    def _admit(self) -> None:
        """Fill free decode capacity from the pending queue (priority, then arrival)."""
        if not self.pending_decode:
            return
        self.pending_decode = [r for r in self.pending_decode
                               if r in self.tracked and self.tracked[r].stage == "pending_decode"]
        self.pending_decode.sort(key=lambda r: (self.tracked[r].req.priority, self.tracked[r].req.arrival_time))
        still: list[str] = []
        for rid in self.pending_decode:
            t = self.tracked[rid]
            if t.handle is None:  # colocated: the decode worker prefills it too
                need = self._blocks_needed(len(t.req.prompt_token_ids))
                best, cached = self._pick_whole(t, need)
                if best is None:
                    still.append(rid)
                else:
                    self._run_whole(t, best, need, cached)
                continue
            need = self._blocks_needed(t.handle.num_tokens)
            best = self._pick_decode(need)
            prefill = self.prefill.get(t.prefill_worker_id or "")
            if best is None or prefill is None:
                still.append(rid)
                continue
            best.reserved_blocks += need
            best.reserved_seqs += 1
            t.stage, t.worker_id = "admitting", best.worker_id
            self.counters["admitted"] += 1
            ref = best.actor.admit.remote(t.req, t.handle, prefill.actor)
            asyncio.get_event_loop().create_task(self._admitted(rid, best, need, ref))
        self.pending_decode = still

    async def _admitted(self, rid: str, w: _Worker, need: int, ref) -> None:
        try:
            ok = await asyncio.wait_for(ref, self.config.kv_transfer_timeout_s * 2 + 5)
        except Exception as exc:  # noqa: BLE001 - a dead or stuck decode worker: re-prefill elsewhere
            logger.warning("admit of %s on %s failed: %r", rid, w.worker_id, exc)
            ok = False
        self._unreserve(w, need, ok)
        t = self.tracked.get(rid)
        if t is not None and t.stage == "admitting" and t.worker_id == w.worker_id:
            if ok:
                t.stage = "decode"
            else:
                self.counters["transfer_failures"] += 1
                metrics.count_transfer_failure()
                await self._requeue(t, "KV transfer failed", "retries")
        self._admit()

    def _unreserve(self, w: _Worker, need: int, taken: bool, prefill_tokens: int = 0) -> None:
        w.reserved_blocks -= need
        w.reserved_seqs -= 1
        w.reserved_prefill_tokens -= prefill_tokens
        if w.report is not None and taken:  # until its next report, count the blocks as taken
            w.report = replace(w.report, num_free_blocks=w.report.num_free_blocks - (need - 1),
                               num_running=w.report.num_running + 1,
                               prefill_backlog=w.report.prefill_backlog + prefill_tokens)

    async def _delivered(self, req: GenRequest) -> list[int] | None:
        """The tokens `req`'s client already has (None: its ingress replica is gone, and so is it)."""
        try:
            return await asyncio.wait_for(req.hub.delivered.remote(req.request_id), 10)
        except Exception:  # noqa: BLE001
            return None

    async def _requeue(self, t: _Tracked, why: str, counter: str, moving: _Moves | None = None,
                       delivered: list[int] | None | object = _FETCH) -> None:
        """Prefill again from the prompt plus every token the client already has, then decode on.

        `moving`: the moves placed before this one in the same batch (a dead decode worker's
        sequences), so that they are spread over the survivors and the prefill pool.
        `delivered`: the client's tokens when the caller fetched them already (default: fetch them)."""
        if t.stage == "requeueing":  # the death watch and a failed call may both report it
            return
        t.stage = "requeueing"
        req = t.req
        rid = req.request_id
        if req.attempt + 1 >= MAX_ATTEMPTS:
            self._fail(t, f"gave up after {MAX_ATTEMPTS} attempts: {why}")
            return
        if delivered is _FETCH:
            delivered = await self._delivered(req)
        if delivered is None or self.tracked.get(rid) is not t:
            self.tracked.pop(rid, None)
            return
        self.counters[counter] += 1
        metrics.count_requeue(counter)
        n = len(delivered)
        prompt = req.prompt_token_ids[:req.num_original_prompt_tokens] + delivered
        remaining = t.params.max_tokens - n
        if remaining <= 0 or len(prompt) >= self._max_model_len():
            self.tracked.pop(rid, None)
            req.hub.push.remote([StreamEvent(rid, n, [], True, "length", num_prompt_tokens=req.num_original_prompt_tokens)])
            return
        params = replace(t.params, max_tokens=remaining, min_tokens=max(0, t.params.min_tokens - n))
        t.req = replace(req, prompt_token_ids=prompt, params=params, offset=n, attempt=req.attempt + 1)
        t.handle = None
        if counter == "migrations":
            self._place_moved(t, moving if moving is not None else _Moves())
        else:
            self._place_prefill(rid, allow_local=False)

    def _place_moved(self, t: _Tracked, moving: _Moves) -> None:
        """Place a sequence of a dead decode worker where its next token comes soonest, by the prompt
        tokens each destination has to compute first:
        - a live decode worker recomputes it in its running batch (`_run_whole`): its queued prompt
          tokens (moved sequences, local prefills) plus the whole sequence, less what it has cached;
        - the same, but it first pulls the part of the sequence a prefill worker has in its prefix
          cache (the prompt that worker prefilled, or a KV backup) and recomputes only the rest
          (`kv_prefix_fetch`). The pull runs during both workers' steps, so it waits for neither;
        - a prefill worker, then KV transfer: the prompt tokens queued there that arrived before this
          request (a moved request keeps its arrival time, so it queues ahead of newer prompts), or
          at least the step under way, and those of the sequences moved there before it, plus the
          sequence, less the prompt blocks still in its prefix cache if it is the worker that
          prefilled this request (they stay cached after the transfer until the space is needed), so
          there only the tokens generated since are recomputed.
        Ties go to the decode worker. Placed one by one (longest first), so several moved sequences
        spread over the pools instead of queueing on one worker. `moving` adds up, by destination,
        the tokens each was given: a prefill worker's queue already holds those moves, so they are
        taken out of its queue and counted once (counted twice, later moves shunned the prefill pool
        and piled up on the surviving decode worker)."""
        n = len(t.req.prompt_token_ids)
        need = self._blocks_needed(n)
        # (tokens computed before its next token, tie-break, destination, its own tokens to compute,
        #  the prefill worker the decode destination pulls the cached prefix from)
        options: list[tuple[int, int, _Worker, int, _Worker | None]] = []
        hashes = self._hashes(t)
        live_prefill = [p for p in self.prefill.values() if p.ready and not p.draining]
        w = self._pick_decode(need)
        if w is not None:
            cached = self._cached(w, hashes, n)
            backlog = self._prefill_backlog(w)  # moves placed there before this one included
            options.append((backlog + n - cached, 0, w, n - cached, None))
            if self.config.fetches_prefix and live_prefill:
                # ... or pulls the part a prefill worker has cached first (`DecodeWorker.resume`)
                fc, p = max(((self._cached(p, hashes, n), p) for p in live_prefill), key=lambda o: o[0])
                if fc > cached:
                    options.append((backlog + n - fc, 0, w, n - fc, p))
        bs = self.config.engine.block_size
        older: dict[str, int] = {}  # prompt tokens queued on each prefill worker that arrived before t
        for o in self.tracked.values():
            if o.stage == "prefill" and o.req.arrival_time <= t.req.arrival_time and o.req.request_id not in moving.ids:
                older[o.worker_id] = older.get(o.worker_id, 0) + o.queued_tokens
        for p in live_prefill:
            cached = self._cached(p, hashes, n)
            if not hashes and self.config.engine.enable_prefix_caching and p.worker_id == t.prefill_worker_id:
                # Caching without the index (prefix_aware_routing off): its prefill worker still has it.
                cached = min(t.req.num_original_prompt_tokens // bs * bs, n - 1)
            # The step under way (its oldest prompts, up to a step's budget) ends first, and moved
            # sequences placed before this one (longer, maybe newer) also run first.
            moved_here = moving.tokens.get(p.worker_id, 0)
            running = min(p.queued_prompt_tokens - moved_here, self.config.engine.max_num_batched_tokens)
            before = max(older.get(p.worker_id, 0), running) + moved_here
            options.append((before + n - cached, 1, p, n - cached, None))
        if not options:
            self._place_prefill(t.req.request_id, allow_local=False)  # waits for a worker
            return
        cost, _, dest, own, src = min(options, key=lambda o: o[:2])
        moving.tokens[dest.worker_id] = moving.tokens.get(dest.worker_id, 0) + own
        moving.ids.add(t.req.request_id)
        self.moves.append({"time": time.time(), "request_id": t.req.request_id, "to": dest.worker_id,
                           "tokens": n, "recompute_tokens": own, "tokens_ahead": cost - own,
                           "fetch_from": src.worker_id if src is not None else None})
        if dest.role == "decode":
            fetch = None
            if src is not None:
                self.counters["prefix_fetches"] += 1
                fetch = (src.worker_id, src.actor, n - own)
            self._run_whole(t, dest, need, n - own, fetch)
        else:
            self._send_to_prefill(t, dest, n - own)

    def _run_whole(self, t: _Tracked, w: _Worker, need: int, cached: int = 0,
                   fetch: tuple[str, Any, int] | None = None) -> None:
        """Hand `t` to decode worker `w` to run from its prompt (colocated, a local prefill or a
        migrated sequence); `fetch`: where it pulls the first `cached` tokens' KV from first."""
        w.reserved_blocks += need
        w.reserved_seqs += 1
        own = len(t.req.prompt_token_ids) - cached  # what it computes, for its backlog until it reports
        w.reserved_prefill_tokens += own
        t.stage, t.worker_id, t.prefill_worker_id = "admitting", w.worker_id, None
        self._computes(t, w, cached)
        if t.req.attempt == 0:
            self.counters["admitted"] += 1
        ref = w.actor.resume.remote(t.req, self._backup_target(t) if self.config.backs_up_kv else None, fetch)
        asyncio.get_event_loop().create_task(self._resumed(t, w, need, own, ref))

    def _backup_target(self, t: _Tracked) -> tuple[str, Any, int] | None:
        """Where a decode worker about to compute `t`'s prompt copies it (`DecodeWorker.resume`): the
        prefill worker holding most of it already (then the least queued), and from which block on."""
        n = len(t.req.prompt_token_ids)
        hashes = self._hashes(t)
        full = n // self.config.engine.block_size
        options = [(-self._cached(p, hashes, n), p.queued_prompt_tokens, p.worker_id, p)
                   for p in self.prefill.values() if p.ready and not p.draining]
        if not full or not options:
            return None
        neg_cached, _, _, p = min(options, key=lambda o: o[:3])
        first = -neg_cached // self.config.engine.block_size
        return (p.worker_id, p.actor, first) if first < full else None

    async def on_kv_backup(self, worker_id: str, request_id: str, num_tokens: int, copied_tokens: int) -> None:
        """Prefill worker `worker_id` has `request_id`'s first `num_tokens` tokens of KV cached, the last
        `copied_tokens` of them just copied from a decode worker."""
        t = self.tracked.get(request_id)
        self.counters["kv_backups"] += 1
        self.counters["kv_backup_tokens"] += copied_tokens
        if t is not None and worker_id in self.prefill:
            self.prefix_index.record(worker_id, self._hashes(t)[:num_tokens // self.config.engine.block_size])

    async def _resumed(self, t: _Tracked, w: _Worker, need: int, own: int, ref) -> None:
        try:  # a fetch of the cached prefix takes a lease call and a pull, each with this timeout
            ok = await asyncio.wait_for(ref, self.config.kv_transfer_timeout_s * 2 + 5)
        except Exception as exc:  # noqa: BLE001 - it died too: the death watch moves it again
            logger.warning("run of %s on %s failed: %r", t.req.request_id, w.worker_id, exc)
            ok = None
        self._unreserve(w, need, ok is True, own)
        if self.tracked.get(t.req.request_id) is not t or t.stage != "admitting" or t.worker_id != w.worker_id:
            return
        if ok is True:
            t.stage = "decode"
        elif ok is None:
            await self._requeue(t, f"run on {w.worker_id} failed", "migrations")
        elif self.config.colocated:  # the engine refused it: there is nowhere else it could run
            self._fail(t, f"{w.worker_id} refused the request: {ok}")
        else:
            self._place_prefill(t.req.request_id, allow_local=False)
        self._admit()

    def _fail(self, t: _Tracked, message: str) -> None:
        self.tracked.pop(t.req.request_id, None)
        self.counters["failed"] += 1
        t.req.hub.push.remote([StreamEvent(t.req.request_id, t.req.offset, [], True, "error", message)])

    def _max_model_len(self) -> int:
        for p in self.pools.values():
            for w in p.values():
                if w.info:
                    return w.info["max_model_len"]
        return 1 << 30

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
        elif t.stage in ("admitting", "decode"):
            w = self.decode.get(t.worker_id or "")
            if w is not None:
                w.actor.abort.remote(request_id)

    # ------------------------------------------------------------------ failures
    async def _monitor(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self._export_gauges()
            workers = [w for p in self.pools.values() for w in p.values() if w.ready]
            results = await asyncio.gather(*[asyncio.wait_for(w.actor.ping.remote(), self.config.health_check_timeout_s)
                                             for w in workers], return_exceptions=True)
            for w, r in zip(workers, results):
                if isinstance(r, (ray.exceptions.RayActorError, asyncio.TimeoutError)):
                    await self._on_worker_dead(w, repr(r))

    def _export_gauges(self) -> None:
        prefill_queue = sum(1 for t in self.tracked.values() if t.stage in ("unplaced", "prefill"))
        metrics.set_pool_state("prefill", prefill_queue, len(self.prefill))
        metrics.set_pool_state("decode", len(self.pending_decode), len(self.decode))

    async def _on_worker_dead(self, w: _Worker, why: str) -> None:
        if self.pools[w.role].pop(w.worker_id, None) is None:
            return
        self.prefix_index.remove_worker(w.worker_id)
        self.counters["worker_deaths"] += 1
        metrics.count_worker_death(w.role)
        logger.warning("%s died (%s); moving its requests", w.worker_id, why)
        self._decide(w.role, "replace" if not w.draining else "drained", len(self.pools[w.role]) + 1,
                     len(self.pools[w.role]), f"{w.worker_id} died")
        try:
            ray.kill(w.actor)
        except Exception:  # noqa: BLE001
            pass
        lost = []
        for t in list(self.tracked.values()):
            if w.role == "prefill" and (t.prefill_worker_id == w.worker_id and t.stage in ("prefill", "pending_decode")):
                lost.append((t, "retries"))
            elif w.role == "decode" and t.worker_id == w.worker_id and t.stage in ("admitting", "decode"):
                lost.append((t, "migrations"))
        # The clients' tokens, fetched at once: a moved sequence recomputes its prompt plus these.
        delivered = await asyncio.gather(*[self._delivered(t.req) for t, _ in lost])
        # NOTE: longest recompute first (within a priority), each to the least loaded destination
        # (`_place_moved`): the longest-processing-time rule, so the last client to get its next
        # token waits for about the longest sequence, not for two long ones on one worker. Placed in
        # arrival order, two long sequences could land together (measured: a 1.99 s stall, against
        # 1.4-1.6 s when they did not).
        # Streams that have started first: their clients are stalled mid-stream, and their recompute is
        # urgent on its worker (`GenRequest.offset` > 0); one still waiting for its first token (e.g. a
        # local prefill under way) only keeps its place in the queue by its arrival time.
        order = sorted(range(len(lost)), key=lambda i: (
            lost[i][0].req.priority,
            not delivered[i],
            -(lost[i][0].req.num_original_prompt_tokens + len(delivered[i] or ())),
            lost[i][0].req.arrival_time or 0.0))
        moving = _Moves()
        for i in order:
            t, counter = lost[i]
            await self._requeue(t, f"{w.worker_id} died", counter, moving, delivered[i])
        moved = [t for t, c in lost if c == "migrations"]
        if len(moved) > 1:
            logger.info("moved %s's sequences: recompute tokens by destination %s", w.worker_id, moving.tokens)
        self._replacing[w.role] += 1
        asyncio.get_event_loop().create_task(self._replace(w.role, moved))

    async def _replace(self, role: str, moved: list[_Tracked]) -> None:
        """Bring `role`'s pool back to its size, once the sequences `moved` off a dead worker have been
        recomputed (or REPLACE_WAIT_S passed): a new worker loading its model takes CPU (on a CPU node,
        the very cores) the survivors need for that recompute, and every client of a moved sequence
        is stalled until it is done. On GPUs the recompute takes milliseconds, so this costs nothing."""
        try:
            if any(w.ready and not w.draining for w in self.pools[role].values()):  # else nowhere to go
                await self._moved_settled(moved)
        finally:
            self._replacing[role] -= 1
        lo, _ = self.config.pool_bounds(role)
        while len(self.pools[role]) < max(lo, self.scale[role].desired):
            asyncio.get_event_loop().create_task(self._until_ready(self._spawn(role)))

    async def _moved_settled(self, moved: list[_Tracked]) -> None:
        deadline = time.monotonic() + REPLACE_WAIT_S
        marks: dict[str, int] = {}  # request id -> its new worker's step count when it joined there
        while moved and time.monotonic() < deadline:
            waiting = False
            for t in moved:
                rid = t.req.request_id
                if self.tracked.get(rid) is not t:
                    continue  # finished or aborted
                w = self.decode.get(t.worker_id or "")
                if t.stage != "decode" or w is None:
                    waiting = True
                    continue
                marks.setdefault(rid, w.num_steps)
                waiting |= w.num_steps < marks[rid] + 2  # a whole step ran after it joined
            if not waiting:
                break
            await asyncio.sleep(0.05)

    # ------------------------------------------------------------------ autoscaling
    def _decide(self, pool: str, action: str, frm: int, to: int, reason: str) -> None:
        self.decisions.append({"time": time.time(), "pool": pool, "action": action, "from": frm, "to": to,
                               "reason": reason})
        logger.info("autoscale %s: %s %d -> %d (%s)", pool, action, frm, to, reason)

    def _desired(self, pool: str) -> tuple[int, str]:
        c = self.config
        lo, hi = c.pool_bounds(pool)
        active = [w for w in self.pools[pool].values() if not w.draining]
        n = len(active)
        if pool == "prefill":
            queued = sum(w.queued_prompt_tokens for w in active) + sum(
                len(self.tracked[r].req.prompt_token_ids) for r in self.unplaced if r in self.tracked)
            want = math.ceil(queued / c.prefill_target_queued_tokens)
            reason = f"{queued} queued prompt tokens, target {c.prefill_target_queued_tokens}/worker"
        else:
            waiting = len(self.pending_decode)
            reports = [w.report for w in active if w.report is not None]
            use = (sum(1 - r.num_free_blocks / r.num_total_blocks for r in reports) / len(reports)) if reports else 0.0
            running = sum(r.num_running for r in reports)
            if waiting > c.decode_target_waiting * max(n, 1) or use > c.decode_target_kv_use:
                want = n + 1
            elif waiting == 0 and n > 1 and use * n / (n - 1) < c.decode_target_kv_use / 2 and \
                    running <= c.max_num_seqs * (n - 1) // 2:
                want = n - 1
            else:
                want = n
            reason = f"{waiting} waiting for a slot, KV use {use:.0%}, {running} running"
        return max(lo, min(hi, want)), reason

    async def _autoscale(self) -> None:
        c = self.config
        while True:
            await asyncio.sleep(c.autoscale_interval_s)
            now = time.time()
            for pool in ("prefill", "decode"):
                st = self.scale[pool]
                active = [w for w in self.pools[pool].values() if not w.draining]
                want, reason = self._desired(pool)
                st.desired, st.reason = want, reason
                direction = (want > len(active)) - (want < len(active))
                if direction != st.signal_dir:
                    st.signal_dir, st.signal_since = direction, now
                held = now - (st.signal_since or now)
                if direction > 0 and held >= c.upscale_delay_s and not self._replacing[pool]:
                    self._decide(pool, "scale_up", len(active), want, reason)
                    self.counters["scale_ups"] += 1
                    for _ in range(want - len(active)):
                        asyncio.get_event_loop().create_task(self._until_ready(self._spawn(pool)))
                    st.signal_dir, st.signal_since = 0, now
                elif direction < 0 and held >= c.downscale_delay_s:
                    victim = min(active, key=lambda w: self._load(w))
                    victim.draining = True
                    self._decide(pool, "scale_down", len(active), len(active) - 1, reason + f"; draining {victim.worker_id}")
                    self.counters["scale_downs"] += 1
                    st.signal_dir, st.signal_since = 0, now
            await self._finish_drains()
            await self._rebalance_prefill()

    async def _rebalance_prefill(self) -> None:
        """Requests are placed on a prefill worker when they arrive; when one worker's queue runs more
        than two steps ahead of another's (a worker just joined after a burst, or one is draining),
        move not-yet-started requests from the longest queue to the shortest."""
        ready = [w for w in self.prefill.values() if w.ready]
        takers = [w for w in ready if not w.draining]
        if len(ready) < 2 or not takers:
            return
        src = max(ready, key=lambda w: (w.draining, w.queued_prompt_tokens))
        dst = min(takers, key=lambda w: w.queued_prompt_tokens)
        gap = src.queued_prompt_tokens - dst.queued_prompt_tokens
        if src is dst or (gap <= 2 * self.config.engine.max_num_batched_tokens and not (src.draining and src.queued_prompt_tokens)):
            return
        try:
            # A draining worker hands over everything not started; otherwise split the difference.
            want = src.queued_prompt_tokens if src.draining else gap // 2
            reqs = await asyncio.wait_for(src.actor.release_queued.remote(max(1, want)), 10)
        except Exception:  # noqa: BLE001 - dead or busy: the monitor deals with it
            return
        moved = 0
        for req in reqs:
            t = self.tracked.get(req.request_id)
            if t is None or t.stage != "prefill" or t.worker_id != src.worker_id:
                continue  # aborted meanwhile
            self._prefill_done(t)
            t.queued_tokens = len(t.req.prompt_token_ids)
            dst.queued_prompt_tokens += t.queued_tokens
            t.worker_id = t.prefill_worker_id = dst.worker_id
            self._computes(t, dst, 0)
            dst.actor.add.remote(t.req)
            moved += 1
        if moved:
            self.counters["rebalanced"] += moved
            logger.info("moved %d queued prompts from %s to %s", moved, src.worker_id, dst.worker_id)

    def _load(self, w: _Worker) -> int:
        return sum(1 for t in self.tracked.values() if w.worker_id in (t.worker_id, t.prefill_worker_id))

    async def _finish_drains(self) -> None:
        """A draining worker takes no new work; once nothing of it is tracked, it closes and exits."""
        for pool in self.pools.values():
            for w in list(pool.values()):
                if w.draining and self._load(w) == 0:
                    pool.pop(w.worker_id, None)
                    self.prefix_index.remove_worker(w.worker_id)
                    try:
                        await asyncio.wait_for(w.actor.close.remote(), 10)
                    except Exception:  # noqa: BLE001
                        pass
                    ray.kill(w.actor)

    # ------------------------------------------------------------------ introspection
    async def stats(self) -> dict:
        def pool_view(pool: str) -> dict:
            st = self.scale[pool]
            lo, hi = self.config.pool_bounds(pool)
            return {"size": len(self.pools[pool]), "ready": sum(w.ready for w in self.pools[pool].values()),
                    "draining": sum(w.draining for w in self.pools[pool].values()), "min": lo, "max": hi,
                    "desired": st.desired, "signal": st.reason}

        return {
            "counters": dict(self.counters),
            "num_tracked": len(self.tracked),
            "num_pending_decode": len(self.pending_decode),
            "num_unplaced": len(self.unplaced),
            "pools": {"prefill": pool_view("prefill"), "decode": pool_view("decode")},
            "decisions": list(self.decisions)[-20:],
            "moves": list(self.moves)[-20:],
            "prefill": {w.worker_id: {"queued_prompt_tokens": w.queued_prompt_tokens, "ready": w.ready,
                                      "draining": w.draining, "node_id": w.info.get("node_id"),
                                      "created_at": w.created_at, "ready_at": w.ready_at}
                        for w in self.prefill.values()},
            "decode": {w.worker_id: {"max_batch_seen": w.max_batch_seen, "num_steps": w.num_steps,
                                     "free_blocks": w.report.num_free_blocks if w.report else None,
                                     "running": w.report.num_running if w.report else 0,
                                     "prefill_backlog": self._prefill_backlog(w), "ready": w.ready,
                                     "draining": w.draining, "node_id": w.info.get("node_id")}
                       for w in self.decode.values()},
        }

    async def workers(self) -> dict[str, Any]:
        return {w.worker_id: w.actor for p in self.pools.values() for w in p.values()}

    async def check_integrity(self) -> dict:
        """Runs every live worker's block-manager integrity check; returns their block use."""
        workers = [w for p in self.pools.values() for w in p.values() if w.ready]
        res = await asyncio.gather(*[w.actor.check_integrity.remote() for w in workers])
        return {w.worker_id: r for w, r in zip(workers, res)}

    async def shutdown(self) -> None:
        for t in self._tasks:
            t.cancel()
        for p in self.pools.values():
            for w in list(p.values()):
                try:
                    ray.kill(w.actor)
                except Exception:  # noqa: BLE001
                    pass
            p.clear()


# NOTE: restartable: a new incarnation adopts the detached workers and rebuilds from their snapshots;
# calls made while it restarts are retried rather than failed.
RouterActor = ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)(Router)
