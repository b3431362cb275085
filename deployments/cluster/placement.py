"""Where each request runs: the router's placement and decode admission, as plain bookkeeping.

    new prompt ─▶ place_prefill: the prefill worker that gets through its queue and the prompt's
                  uncached part first, or a decode worker (local prefill) when that is sooner
    prefilled  ─▶ pending-decode queue ─▶ admit: the decode worker with room (after every report)
    colocated  ─▶ pending-decode queue ─▶ admit: run whole where its prefix is cached, or load wins
    moved      ─▶ place_moved: a dead decode worker's sequence, where its next token comes soonest

Every method updates `RouterState` (stages, queue lengths, reservations, the prefix index) and returns
the `Action`s (Ray calls) the router actor then makes; nothing here holds a Ray handle.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple

from deployments.cluster.actions import (AbortOn, Action, AdmitKV, BackupTarget, PrefixFetch, ReleaseKV, RunWhole,
                                         ToPrefill)
from deployments.cluster.messages import DecodeReport, Role
from deployments.cluster.prefix_index import block_hashes
from deployments.cluster.state import MoveRecord, RouterState, Stage, Tracked, WorkerView, blocks_to_admit
from deployments.config import ServeConfig
from kv_transfer import KVHandle

# Conditional disaggregation: a decode worker's queued prompt tokens count this many times against a
# prefill worker's, since it also has to keep decoding its running sequences.
LOCAL_PREFILL_COST = 2.0
# Colocated cache-aware placement: a decode worker holding a prompt's prefix gets it while it runs at
# most this many more sequences than the least loaded worker with room.
AFFINITY_SLACK_SEQS = 4


@dataclass(slots=True)
class Moves:
    """One dead decode worker's sequences, being placed one by one (`Placement.place_moved`)."""

    tokens: dict[str, int] = field(default_factory=dict)  # recompute tokens given to each destination
    ids: set[str] = field(default_factory=set)  # the requests placed so far


class _Option(NamedTuple):
    """A destination for a moved sequence (`Placement.place_moved`)."""

    cost: int  # prompt tokens computed there before its next token
    tie: int  # 0: a decode worker, 1: a prefill worker (ties go to the decode worker)
    dest: WorkerView
    own: int  # its own tokens to compute there
    src: WorkerView | None  # the prefill worker a decode destination pulls the cached prefix from


class Placement:
    def __init__(self, config: ServeConfig, state: RouterState):
        self.config = config
        self.state = state
        self.block_size = config.engine.block_size
        self.max_num_seqs = config.engine.max_num_seqs

    # ------------------------------------------------------------------ the prefix caches' picture
    def hashes(self, t: Tracked) -> list[bytes]:
        """`t`'s prompt's block hashes ([] without prefix-aware routing), computed once per prompt."""
        if not self.config.routes_by_prefix:
            return []
        if t.hashes is None or t.hashes_of is not t.req:  # NOTE: colocated, `admit` asks at every report
            t.hashes, t.hashes_of = block_hashes(t.req.prompt_token_ids, self.block_size, t.req.cache_salt), t.req
        return t.hashes

    def cached(self, w: WorkerView, hashes: list[bytes], num_tokens: int) -> int:
        """Prompt tokens `w` likely has in its prefix cache (0 without prefix-aware routing)."""
        return self.state.prefix_index.cached_tokens(w.worker_id, hashes, num_tokens) if hashes else 0

    def _computes(self, t: Tracked, w: WorkerView, cached: int) -> None:
        """`w` is about to compute `t`'s prompt: its blocks will be in `w`'s prefix cache."""
        if cached:
            self.state.counters.prefix_routed += 1
            self.state.counters.prefix_routed_tokens += cached
        self.state.prefix_index.record(w.worker_id, self.hashes(t))

    def record_backup(self, worker_id: str, request_id: str, num_tokens: int, copied_tokens: int) -> None:
        """Prefill worker `worker_id` caches `request_id`'s first `num_tokens` tokens, the last
        `copied_tokens` of them just copied from a decode worker (`PrefillWorker.kv_backup`)."""
        c = self.state.counters
        c.kv_backups += 1
        c.kv_backup_tokens += copied_tokens
        t = self.state.tracked.get(request_id)
        if t is not None and worker_id in self.state.prefill:
            self.state.prefix_index.record(worker_id, self.hashes(t)[:num_tokens // self.block_size])

    # ------------------------------------------------------------------ prefill
    def place_prefill(self, t: Tracked, allow_local: bool = True) -> list[Action]:
        """Send `t`'s prompt where it is computed soonest; colocated, queue it for a decode worker."""
        if self.config.colocated:
            return self._queue_whole(t)
        candidates = [w for w in self.state.prefill.values() if w.takes_work]
        if not candidates:
            t.stage = Stage.UNPLACED
            if t.req.request_id not in self.state.unplaced:
                self.state.unplaced.append(t.req.request_id)
            return []
        # Cache-aware: the worker that gets through its queue and this prompt's uncached part first.
        n = len(t.req.prompt_token_ids)
        hashes = self.hashes(t)
        cost, cached, w = min(((w.queued_prompt_tokens + n - c, -c, w) for w in candidates
                               for c in [self.cached(w, hashes, n)]), key=lambda o: o[:2])
        local = self._local_prefill(t, cost) if allow_local else None
        return [local if local is not None else self.send_to_prefill(t, w, -cached)]

    def send_to_prefill(self, t: Tracked, w: WorkerView, cached: int = 0) -> ToPrefill:
        t.queued_tokens = len(t.req.prompt_token_ids) - cached
        w.queued_prompt_tokens += t.queued_tokens
        t.stage, t.worker_id, t.prefill_worker_id, t.handle = Stage.PREFILL, w.worker_id, w.worker_id, None
        t.adding = True
        self._computes(t, w, cached)
        return ToPrefill(t, w.worker_id)

    def _local_prefill(self, t: Tracked, prefill_cost: int) -> RunWhole | None:
        """Conditional disaggregation: run a short prompt whole on a decode worker (chunked prefill
        mixed into its batch, no KV transfer) when the prefill pool is the bottleneck, i.e. when that
        decode worker would get through it sooner than the best prefill worker, which has
        `prefill_cost` tokens to compute first (its queue and this prompt's uncached part). Without
        it, a busy prefill pool leaves the decode pool idle. A longer prompt may go only to a mixed
        decode worker (`WorkerView.mixed`: both roles, as colocated), on the same terms."""
        n = len(t.req.prompt_token_ids)
        long = n > self.config.local_prefill_max_tokens
        if long and not any(w.mixed for w in self.state.decode.values()):
            return None
        need = blocks_to_admit(n, self.block_size)
        hashes = self.hashes(t)
        best, best_cost, best_cached = None, 0, 0
        for w in self.state.decode.values():
            if (long and not w.mixed) or not w.has_room(need, self.max_num_seqs):
                continue
            cached = self.cached(w, hashes, n)
            cost = w.prefill_backlog() + n - cached
            if best is None or cost < best_cost:
                best, best_cost, best_cached = w, cost, cached
        if best is None or LOCAL_PREFILL_COST * best_cost >= prefill_cost:
            return None
        self.state.counters.local_prefills += 1
        return self.run_whole(t, best, need, best_cached)

    def prefill_done(self, t: Tracked) -> None:
        """`t` left its prefill worker's queue (prefilled, finished, aborted or moved)."""
        w = self.state.worker(t.prefill_worker_id)
        if w is not None:
            w.queued_prompt_tokens = max(0, w.queued_prompt_tokens - t.queued_tokens)
        t.queued_tokens = 0

    def prefilled(self, worker_id: str, request_id: str, handle: KVHandle) -> list[Action]:
        """Prefill worker `worker_id` leased `request_id`'s KV: queue it for a decode slot."""
        t = self.state.tracked.get(request_id)
        if t is None or t.stage is not Stage.PREFILL or t.prefill_worker_id != worker_id:
            # aborted or moved meanwhile: free the blocks now
            return [ReleaseKV(worker_id, request_id, handle.epoch)] if self.state.worker(worker_id) else []
        self.prefill_done(t)
        t.stage, t.handle, t.worker_id = Stage.PENDING_DECODE, handle, None
        self.state.pending_decode.append(request_id)
        return self.admit()

    def flush_unplaced(self) -> list[Action]:
        """A worker joined: place the requests that found no prefill worker."""
        rids, self.state.unplaced = self.state.unplaced, []
        return [a for rid in rids if rid in self.state.tracked for a in self.place_prefill(self.state.tracked[rid])]

    def finished(self, worker_id: str, request_id: str) -> None:
        t = self.state.finish(worker_id, request_id)
        if t is not None and t.stage is Stage.PREFILL:
            self.prefill_done(t)

    def abort(self, request_id: str) -> list[Action]:
        """The client went away: forget `request_id` and free what it holds."""
        t = self.state.tracked.pop(request_id, None)
        if t is None:  # ended already, or its submit is still on its way: that one is dropped
            self.state.early_aborts.add(request_id)
            return []
        self.state.counters.aborted += 1
        if t.stage is Stage.PREFILL:
            self.prefill_done(t)
            if self.state.worker(t.worker_id) is not None:
                # NOTE: a worker runs its calls on a thread pool, so an abort sent right after the
                # `add` may run before it: one in flight leaves a mark that drops the `add`.
                return [AbortOn(t.worker_id, request_id, t.req.attempt, t.adding)]
        elif t.stage is Stage.PENDING_DECODE:
            if self.state.worker(t.prefill_worker_id) is not None and t.handle is not None:
                return [ReleaseKV(t.prefill_worker_id, request_id, t.handle.epoch)]
        elif t.stage in (Stage.ADMITTING, Stage.DECODE):
            if self.state.worker(t.worker_id) is not None:
                return [AbortOn(t.worker_id, request_id, t.req.attempt, t.stage is Stage.ADMITTING)]
        return []

    # ------------------------------------------------------------------ decode admission
    def reported(self, report: DecodeReport) -> list[Action]:
        """A decode worker's step report: fill the capacity it freed at once. (A worker that left the
        decode role reports while it still holds sequences: their ends count.)"""
        w = self.state.worker(report.worker_id)
        if w is None:
            return []
        w.take_report(report)  # its counts, unless a newer report came first (its finished ids count)
        if report.kv_pairs is not None:
            w.kv_pairs = report.kv_pairs
        w.num_steps = max(w.num_steps + 1, report.num_steps)
        w.max_batch_seen = max(w.max_batch_seen, report.batch_size)
        for rid in report.finished_ids:
            self.state.finish(report.worker_id, rid)
        return self.admit()

    def pick_decode(self, need: int, not_on: str | None = None) -> WorkerView | None:
        """The ready decode worker with the most free blocks, if it has `need` blocks and a slot (other
        than `not_on`: the worker the KV is leased on, which joined the decode pool since)."""
        best, best_free = None, -1
        for w in self.state.decode.values():
            free_blocks, _ = w.free_capacity(self.max_num_seqs)
            if w.has_room(need, self.max_num_seqs) and free_blocks > best_free and w.worker_id != not_on:
                best, best_free = w, free_blocks
        return best

    def pick_whole(self, t: Tracked, need: int) -> tuple[WorkerView | None, int]:
        """Colocated: the decode worker to run `t` whole, and the prompt tokens it likely has cached.
        The worker with the longest cached prefix, unless it holds more than AFFINITY_SLACK_SEQS
        sequences above the least loaded one with room (then load wins: the most free blocks, as
        without a cache)."""
        best = self.pick_decode(need)
        hashes = self.hashes(t)
        if best is None or not hashes:
            return best, 0
        n = len(t.req.prompt_token_ids)
        room = [(w, self.max_num_seqs - w.free_capacity(self.max_num_seqs)[1], self.cached(w, hashes, n))
                for w in self.state.decode.values() if w.has_room(need, self.max_num_seqs)]
        least = min(load for _, load, _ in room)
        near = [(cached, w) for w, load, cached in room if load <= least + AFFINITY_SLACK_SEQS and cached]
        if near:
            cached, w = max(near, key=lambda o: o[0])
            return w, cached
        return best, self.cached(best, hashes, n)

    def _queue_whole(self, t: Tracked) -> list[Action]:
        """Colocated: wait for a decode worker with room, which then runs the request whole."""
        t.stage, t.handle, t.worker_id, t.prefill_worker_id = Stage.PENDING_DECODE, None, None, None
        if t.req.request_id not in self.state.pending_decode:
            self.state.pending_decode.append(t.req.request_id)
        return self.admit()

    def admit(self) -> list[Action]:
        """Fill free decode capacity from the pending queue (priority, then arrival)."""
        s = self.state
        if not s.pending_decode:
            return []
        s.pending_decode = [r for r in s.pending_decode
                            if r in s.tracked and s.tracked[r].stage is Stage.PENDING_DECODE]
        s.pending_decode.sort(key=lambda r: (s.tracked[r].req.priority, s.tracked[r].req.arrival_time))
        if any(s.tracked[r].req.tenant is not None for r in s.pending_decode):
            s.pending_decode = fair_pending(s)
        still: list[str] = []
        actions: list[Action] = []
        for rid in s.pending_decode:
            t = s.tracked[rid]
            if t.handle is None:  # colocated: the decode worker prefills it too
                need = blocks_to_admit(len(t.req.prompt_token_ids), self.block_size)
                best, cached = self.pick_whole(t, need)
                if best is None:
                    still.append(rid)
                else:
                    actions.append(self.run_whole(t, best, need, cached))
                continue
            need = blocks_to_admit(t.handle.num_tokens, self.block_size)
            best = self.pick_decode(need, not_on=t.prefill_worker_id)
            if best is None or s.worker(t.prefill_worker_id) is None:
                still.append(rid)
                continue
            best.reserve(need)
            t.stage, t.worker_id = Stage.ADMITTING, best.worker_id
            s.counters.admitted += 1
            actions.append(AdmitKV(t, best, t.prefill_worker_id, need))
        s.pending_decode = still
        return actions

    def run_whole(self, t: Tracked, w: WorkerView, need: int, cached: int = 0,
                  fetch: PrefixFetch | None = None) -> RunWhole:
        """Hand `t` to decode worker `w` to run from its prompt (colocated, a local prefill or a
        migrated sequence); `fetch`: where it pulls the first `cached` tokens' KV from first."""
        own = len(t.req.prompt_token_ids) - cached  # what it computes, for its backlog until it reports
        w.reserve(need, own)
        t.stage, t.worker_id, t.prefill_worker_id = Stage.ADMITTING, w.worker_id, None
        self._computes(t, w, cached)
        if t.req.attempt == 0:
            self.state.counters.admitted += 1
        return RunWhole(t, w, need, own, fetch, self.backup_target(t) if self.config.backs_up_kv else None)

    def backup_target(self, t: Tracked) -> BackupTarget | None:
        """Where a decode worker about to compute `t`'s prompt copies it (`DecodeWorker.resume`): the
        prefill worker holding most of it already (then the least queued), and from which block on."""
        n = len(t.req.prompt_token_ids)
        hashes = self.hashes(t)
        full = n // self.block_size
        options = [(-self.cached(p, hashes, n), p.queued_prompt_tokens, p.worker_id)
                   for p in self.state.prefill.values() if p.takes_work]
        if not full or not options:
            return None
        neg_cached, _, worker_id = min(options)
        first = -neg_cached // self.block_size
        return BackupTarget(worker_id, first) if first < full else None

    # ------------------------------------------------------------------ moved sequences
    def place_moved(self, t: Tracked, moving: Moves) -> list[Action]:
        """Place a sequence of a dead decode worker where its next token comes soonest, by the prompt
        tokens each destination has to compute first (`_decode_options`, `_prefill_options`). Ties go
        to the decode worker. Placed one by one (longest first), so several moved sequences spread
        over the pools instead of queueing on one worker. `moving` adds up, by destination, the
        tokens each was given: a prefill worker's queue already holds those moves, so they are taken
        out of its queue and counted once (counted twice, later moves shunned the prefill pool and
        piled up on the surviving decode worker)."""
        n = len(t.req.prompt_token_ids)
        need = blocks_to_admit(n, self.block_size)
        hashes = self.hashes(t)
        live_prefill = [p for p in self.state.prefill.values() if p.takes_work]
        options = self._decode_options(n, need, hashes, live_prefill) + \
            self._prefill_options(t, n, hashes, live_prefill, moving)
        if not options:
            return self.place_prefill(t, allow_local=False)  # waits for a worker
        best = min(options, key=lambda o: (o.cost, o.tie))
        dest, own, src = best.dest, best.own, best.src
        moving.tokens[dest.worker_id] = moving.tokens.get(dest.worker_id, 0) + own
        moving.ids.add(t.req.request_id)
        self.state.moves.append(MoveRecord(time.time(), t.req.request_id, dest.worker_id, n, own, best.cost - own,
                                           src.worker_id if src is not None else None))
        if dest.role is Role.PREFILL:
            return [self.send_to_prefill(t, dest, n - own)]
        fetch = None
        if src is not None:
            self.state.counters.prefix_fetches += 1
            fetch = PrefixFetch(src.worker_id, n - own)
        return [self.run_whole(t, dest, need, n - own, fetch)]

    def _decode_options(self, n: int, need: int, hashes: list[bytes], live_prefill: list[WorkerView]) -> list[_Option]:
        """A live decode worker recomputes the sequence in its running batch (`run_whole`): its queued
        prompt tokens (moved sequences, local prefills) plus the whole sequence, less what it has
        cached. Or the same, but it first pulls the part a prefill worker has in its prefix cache (the
        prompt that worker prefilled, or a KV backup) and recomputes only the rest (`kv_prefix_fetch`).
        The pull runs during both workers' steps, so it waits for neither."""
        w = self.pick_decode(need)
        if w is None:
            return []
        cached = self.cached(w, hashes, n)
        backlog = w.prefill_backlog()  # moves placed there before this one included
        options = [_Option(backlog + n - cached, 0, w, n - cached, None)]
        if self.config.fetches_prefix and live_prefill:
            fc, p = max(((self.cached(p, hashes, n), p) for p in live_prefill), key=lambda o: o[0])
            if fc > cached:
                options.append(_Option(backlog + n - fc, 0, w, n - fc, p))
        return options

    def _prefill_options(self, t: Tracked, n: int, hashes: list[bytes], live_prefill: list[WorkerView],
                         moving: Moves) -> list[_Option]:
        """A prefill worker, then KV transfer: the prompt tokens queued there that arrived before this
        request (a moved request keeps its arrival time, so it queues ahead of newer prompts), or at
        least the step under way, and those of the sequences moved there before it, plus the
        sequence, less the prompt blocks still in its prefix cache if it is the worker that prefilled
        this request (they stay cached after the transfer until the space is needed), so there only
        the tokens generated since are recomputed."""
        bs = self.block_size
        older: dict[str, int] = {}  # prompt tokens queued on each prefill worker that arrived before t
        for o in self.state.tracked.values():
            if o.stage is Stage.PREFILL and o.req.arrival_time <= t.req.arrival_time and \
                    o.req.request_id not in moving.ids:
                older[o.worker_id] = older.get(o.worker_id, 0) + o.queued_tokens
        options = []
        for p in live_prefill:
            cached = self.cached(p, hashes, n)
            if not hashes and self.config.engine.enable_prefix_caching and p.worker_id == t.prefill_worker_id:
                # Caching without the index (prefix_aware_routing off): its prefill worker still has it.
                cached = min(t.req.num_original_prompt_tokens // bs * bs, n - 1)
            # The step under way (its oldest prompts, up to a step's budget) ends first, and moved
            # sequences placed before this one (longer, maybe newer) also run first.
            moved_here = moving.tokens.get(p.worker_id, 0)
            running = min(p.queued_prompt_tokens - moved_here, self.config.engine.max_num_batched_tokens)
            before = max(older.get(p.worker_id, 0), running) + moved_here
            options.append(_Option(before + n - cached, 1, p, n - cached, None))
        return options


def _cost(t: Tracked) -> float:
    """What a tracked request asks of the decode pool (its prompt and output allowance), over its weight."""
    return (len(t.req.prompt_token_ids) + t.req.params.max_tokens) / t.req.tenant_weight


def fair_pending(s: RouterState) -> list[str]:
    """The pending-decode queue (sorted by priority, arrival) in weighted-fair order across tenants: each
    request tagged with its tenant's weighted tokens already on decode workers plus its own and its
    tenant's earlier pending ones (engine/fair_share.py does the same inside each engine), so one
    tenant's flood queues behind another tenant's next request."""
    use: dict[str | None, float] = {}
    for t in s.tracked.values():
        if t.stage in (Stage.ADMITTING, Stage.DECODE):
            use[t.req.tenant] = use.get(t.req.tenant, 0.0) + _cost(t)
    tags: dict[str, float] = {}
    for rid in s.pending_decode:
        t = s.tracked[rid]
        use[t.req.tenant] = tags[rid] = use.get(t.req.tenant, 0.0) + _cost(t)
    return sorted(s.pending_decode, key=lambda r: (s.tracked[r].req.priority, tags[r], s.tracked[r].req.arrival_time))
