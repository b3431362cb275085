"""Token-budget scheduler: chunked prefill, mixed steps, preemption by recompute, three batching policies.

Each request has `num_computed_tokens` catching up with `num_tokens` (vLLM v1 style), so a step is
just "give each scheduled request its next N tokens"; prefill, chunked prefill and decode are the
same thing with different N.
"""

from __future__ import annotations

import itertools

import time
from collections import Counter
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.fair_share import (FairClock, fair_order, has_tenants, pick_victim, running_order, slot_victim,
                               weighted_use)
from engine.request import Request, RequestStatus


# With tenants, while a lighter tenant is active, heavier tenants' prompt tokens in a step are capped
# (together) to `EngineConfig.tenant_prefill_tokens`: `Scheduler._heavy_tenants`. Active: a request here
# now or within the last TENANT_ACTIVE_S seconds. On CUDA the cap defaults to 1/HEAVY_PREFILL_SHARE of the
# prompt budget (a step's time there hardly grows with a few hundred tokens more); on a CPU, where it grows
# about linearly, to HEAVY_PREFILL_BLOCKS blocks.
HEAVY_PREFILL_SHARE = 8
HEAVY_PREFILL_BLOCKS = 1
TENANT_ACTIVE_S = 2.0


@dataclass(slots=True)
class ScheduledChunk:
    request: Request
    num_new_tokens: int  # tokens whose KV this step computes
    # True when this chunk reaches the end of the request's tokens: the step samples a token for it.
    samples: bool
    # Drafts (speculative decoding) at the end of the chunk: a decode chunk of 1 + num_spec tokens,
    # the request's last token then `request.spec_token_ids[:num_spec]`; the step returns logits at
    # all of them to verify the drafts.
    num_spec: int = 0


@dataclass(slots=True)
class _Budget:
    """What is left of one step's budgets while it is scheduled."""

    tokens: int  # all tokens
    prefill: int  # prompt tokens (new prompts, later chunks, recomputes) within `tokens`


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)

    @property
    def empty(self) -> bool:
        return not self.chunks


class Scheduler:
    """Chooses which requests run each step and keeps their block tables.

    It asks the block manager only `blocks_for_tokens / can_allocate / allocate / allocate_contiguous / free`
    (and `lookup / take / register` for the prefix cache).
    """

    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: list[Request] = []  # kept sorted by (priority, arrival)
        self.running: list[Request] = []
        # Prefill-only requests whose KV is held for export, by id.
        self.prefilled: dict[str, Request] = {}
        # static/dynamic batching: how many more requests the current batch may still admit.
        self._batch_quota = 0
        # Offline use sets this: no more arrivals are coming, so a static batch need not wait to fill.
        self.draining = False
        self.num_preemptions = 0
        self.num_cached_tokens = 0  # prompt tokens taken from the prefix cache, all requests so far
        self.fair_clock = FairClock()  # tenants' weighted fair queueing (engine/fair_share.py)
        self._heavy: set[str | None] | None = None  # this step's capped tenants (`_heavy_tenants`)
        self._slot_victim: Request | None = None  # preempted for a fair share this step: not readmitted
        self._heavy_left = 0
        self._active: dict[str | None, float] = {}  # tenant -> when it last had a request here
        self.clock = time.monotonic  # for `_active` (tests set their own)

    # ------------------------------------------------------------------ queue management
    def add(self, request: Request) -> None:
        self.fair_clock.tag(request)
        self._insert_waiting(request)

    def add_running(self, request: Request) -> None:
        """A request whose KV is already in this engine's blocks (imported from a prefill worker)."""
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def _insert_waiting(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        key = request.sort_key
        i = len(self.waiting)
        while i > 0 and self.waiting[i - 1].sort_key > key:
            i -= 1
        self.waiting.insert(i, request)

    def abort(self, request_id: str) -> Request | None:
        for queue in (self.waiting, self.running):
            for i, req in enumerate(queue):
                if req.request_id == request_id:
                    del queue[i]
                    self._free_blocks(req)
                    req.status = RequestStatus.FINISHED_ABORTED
                    return req
        req = self.prefilled.pop(request_id, None)
        if req is not None:
            self._free_blocks(req)
            req.status = RequestStatus.FINISHED_ABORTED
        return req

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Called by the engine after postprocessing decides a request is done."""
        self.running.remove(request)
        request.status = status
        if status is RequestStatus.PREFILLED:
            self.prefilled[request.request_id] = request  # blocks stay until release()
        else:
            self._free_blocks(request)

    def release_prefilled(self, request_id: str) -> bool:
        req = self.prefilled.pop(request_id, None)
        if req is None:
            return False
        self._free_blocks(req)
        return True

    def _free_blocks(self, request: Request) -> None:
        if request.block_table:
            self.block_manager.free(request.block_table)
            request.block_table = []

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ scheduling
    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        # NOTE: preemption by recompute: drop the KV, keep the tokens; on readmission the whole
        # prompt + generated tokens are prefilled again and sampling continues where it stopped.
        self.running.remove(request)
        self._free_blocks(request)
        request.num_computed_tokens = 0
        request.num_registered_blocks = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        if self.config.batching != "continuous":
            self._batch_quota += 1  # it stays part of the batch it was admitted in
        self._insert_waiting(request)
        out.preempted.append(request)

    def _admission_open(self) -> bool:
        policy = self.config.batching
        if policy == "continuous":
            return True
        if self._batch_quota > 0:
            return True
        if self.running or not self.waiting:
            return False
        # The previous batch has run to completion; form the next one.
        full = len(self.waiting) >= self.config.max_num_seqs
        waited = time.monotonic() - min(r.arrival_time for r in self.waiting)
        if full or self.draining or (policy == "dynamic" and waited >= self.config.max_wait_s):
            self._batch_quota = min(self.config.max_num_seqs, len(self.waiting))
            return True
        return False

    def schedule(self) -> SchedulerOutput:
        """This step's chunks: running requests first (preempting from the back when blocks run out),
        then waiting ones, then the drafts of decoding requests in what budget and blocks are left."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        # Prompt tokens (new prompts, later chunks, recomputes) have their own cap inside the budget.
        left = _Budget(budget, self.config.max_prefill_tokens_per_step or budget)
        reserve = 0
        self._heavy = self._slot_victim = None
        tenants_waiting = has_tenants(self.waiting)
        if self.config.batching == "continuous" and (tenants_waiting or has_tenants(self.running)):
            if tenants_waiting:
                # Fair order once a step (the helpers below read its head; with no tenant waiting, any
                # head has tenant None), again only after a preemption put a request back in the queue.
                self.waiting = fair_order(self.waiting)
                if self._make_room_for_fair_share(out):
                    self.waiting = fair_order(self.waiting)
                reserve = self._fair_reserve(left.prefill)
            self._heavy = self._heavy_tenants()
            self._heavy_left = 0 if self._lighter_prompt_starts() else self._heavy_cap(left.prefill)
        slot_preemptions = len(out.preempted)
        left.tokens, left.prefill = left.tokens - reserve, left.prefill - reserve
        self._schedule_running(out, left)
        left.tokens, left.prefill = left.tokens + reserve, left.prefill + reserve
        # Waiting requests and drafts only when this step did not have to preempt for blocks (then
        # memory is the bottleneck); a slot taken for a fair share does not count.
        if len(out.preempted) == slot_preemptions:
            self._schedule_waiting(out, left)
            if self.config.speculative_method != "off":
                self._add_drafts(out, left)
        return out

    def _schedule_running(self, out: SchedulerOutput, left: _Budget) -> None:
        """Running requests, highest priority first; preempt from the back when blocks run out."""
        chunked = self.config.enable_chunked_prefill
        bm = self.block_manager
        scheduled_ids: set[int] = set()
        if has_tenants(self.running):
            self.running = running_order(self.running)  # lightest tenant first: the heaviest's are preempted
        else:
            self.running.sort(key=lambda r: r.sort_key)
        i = 0
        while i < len(self.running) and left.tokens > 0:
            req = self.running[i]
            num_new = req.num_tokens - req.num_computed_tokens
            # A decode is one token; an urgent recompute's client is stalled: the token budget only.
            limit = left.tokens if num_new == 1 or req.urgent else min(left.tokens, left.prefill)
            heavy = num_new > 1 and not req.urgent and self._heavy is not None and req.tenant in self._heavy
            if heavy:
                limit = min(limit, self._heavy_left)
            if num_new > limit:
                if not chunked or limit <= 0:
                    i += 1
                    continue
                num_new = limit
            need = bm.blocks_for_tokens(req.num_computed_tokens + num_new) - len(req.block_table)
            while need > bm.num_free_blocks:
                victim = self._victim(i)
                if id(victim) in scheduled_ids:
                    break
                self._preempt(victim, out)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break  # preempted itself: nothing behind it can run either
            if need > bm.num_free_blocks:
                break
            if need > 0:
                req.block_table.extend(bm.allocate(need))
            samples = req.num_computed_tokens + num_new == req.num_tokens
            out.chunks.append(ScheduledChunk(req, num_new, samples))
            scheduled_ids.add(id(req))
            left.tokens -= num_new
            if num_new > 1:
                left.prefill -= num_new
            if heavy:
                self._heavy_left -= num_new
            i += 1

    def _make_room_for_fair_share(self, out: SchedulerOutput) -> bool:
        """With every sequence slot taken, the next waiting request in fair order (`waiting` is in fair
        order) takes one from the heaviest tenant when that evens the shares out (engine/fair_share.py:
        `slot_victim`). True: a request was preempted (back in `waiting`)."""
        if len(self.running) < self.config.max_num_seqs:
            return False
        victim = slot_victim(self.waiting[0], self.running)
        if victim is not None:
            self._preempt(victim, out)
            # It waits this step at least: with an earlier finish tag (slot_victim weighs the tenants'
            # running tokens, not the tags) it would go ahead of the request it made room for and take
            # the slot back, step after step.
            self._slot_victim = victim
        return victim is not None

    def _heavy_tenants(self) -> set[str | None] | None:
        """The tenants whose prompt tokens this step are capped (`_heavy_cap`, together): while two or more
        tenants are active (a request here, running or waiting, now or in the last TENANT_ACTIVE_S
        seconds), those with prompt work (a running request still prefilling, or any waiting request) that
        ask more of the engine than the lightest active tenant (weighted tokens,
        running and waiting; a tenant with no request here asks nothing). None: no cap.
        So a lighter tenant's prompt shares its step with a slice of the flood's, not with a full budget
        of it (on a CPU a step's time grows with its tokens), and so does its decoding; and its next
        prompt, when it comes, waits for a small step, not a full one of the flood's prompts: also when
        it had no request for a moment (a closed-loop client between two requests)."""
        now = self.clock()
        for r in itertools.chain(self.running, self.waiting):
            self._active[r.tenant] = now
        for t in [t for t, seen in self._active.items() if now - seen > TENANT_ACTIVE_S]:
            del self._active[t]
        # Every waiting request may be admitted this step (behind the head), so its tenant has prompt work.
        prompt_work = {r.tenant for r in self.running if r.num_tokens - r.num_computed_tokens > 1}
        prompt_work.update(r.tenant for r in self.waiting)
        if not prompt_work or len(self._active) < 2:
            return None
        use = weighted_use(itertools.chain(self.running, self.waiting))  # what each asks of the engine
        lightest = min(use[t] for t in self._active)
        heavy = {t for t in prompt_work if use[t] > lightest}
        return heavy or None

    def _fair_head(self) -> Request | None:
        """The waiting request that goes next (`waiting` is in fair order, `schedule`), passing over one
        preempted for a fair share this step: it waits out the step."""
        return next((r for r in self.waiting if r is not self._slot_victim), None)

    def _lighter_prompt_starts(self) -> bool:
        """The next waiting request in fair order is a lighter tenant's (not in `_heavy`) and starts this
        step for sure: a slot is free, blocks for its whole prompt are free, and no running request is
        computing one of its blocks (it would wait for that: shared prefill). Then the heavier tenants'
        prompts get nothing this step: the lighter one's first token waits for its own prompt and the
        decodes, not for a slice of the flood's. Only when it starts for sure: else a capped prefill it
        waits on (a shared block, blocks to free) would never come."""
        if self._heavy is None or len(self.running) >= self.config.max_num_seqs:
            return False
        head = self._fair_head()
        if head is None or head.tenant in self._heavy or head.urgent or head.block_table:
            return False
        bm = self.block_manager
        hits = self._cached_prefix(head)
        key = self._next_uncached_key(head, len(hits))
        if key is not None and key in self._pending_keys(self.running):
            return False
        need = bm.blocks_for_tokens(head.num_tokens) - len(hits)
        return need <= (bm.num_free_after_taking(hits) if hits else bm.num_free_blocks)

    def _heavy_cap(self, prefill_budget: int) -> int:
        """Prompt tokens per step for the tenants of `_heavy_tenants`, together (see the constants)."""
        cap = self.config.tenant_prefill_tokens
        if cap is None:
            if str(self.config.device).startswith("cuda"):
                cap = max(self.block_manager.block_size, prefill_budget // HEAVY_PREFILL_SHARE)
            else:
                cap = HEAVY_PREFILL_BLOCKS * self.block_manager.block_size
        return max(1, min(cap, prefill_budget))

    def _fair_reserve(self, prefill_budget: int) -> int:
        """Prompt tokens held back from the running requests' chunks this step for the next waiting
        request in fair order, when its tenant holds less than a tenant whose running request is still
        prefilling: else a flood's long prompts, chunk after chunk, would take every step's prompt
        budget before a waiting request is looked at. At most half the budget."""
        head = self._fair_head()
        if len(self.running) >= self.config.max_num_seqs or head is None:
            return 0
        use = weighted_use(self.running)
        prefilling = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        if not any(use[r.tenant] > use[head.tenant] for r in prefilling):
            return 0
        return max(0, min(head.num_tokens - head.num_computed_tokens, prefill_budget // 2))

    def _victim(self, i: int) -> Request:
        """Whom to preempt for `running[i]`: the last running request; with tenants, the newest of the
        heaviest tenant among `running[i:]` (engine/fair_share.py), so a flood pays for itself."""
        if not has_tenants(self.running):
            return self.running[-1]
        return pick_victim(self.running[i:], self.running)

    def _schedule_waiting(self, out: SchedulerOutput, left: _Budget) -> None:
        """Waiting requests in order (with tenants: weighted-fair order, engine/fair_share.py). Once an
        urgent prompt is in, only urgent ones follow it. A request whose next uncached full block a
        running request is computing waits for it (shared prefill)."""
        if has_tenants(self.waiting):
            self.waiting = fair_order(self.waiting)
        chunked = self.config.enable_chunked_prefill
        bm = self.block_manager
        urgent = any(c.request.urgent and c.num_new_tokens > 1 for c in out.chunks)
        pending: set[bytes] | None = None  # keys of full blocks running prefills will register
        i = 0
        while i < len(self.waiting) and left.tokens > 0 and len(self.running) < self.config.max_num_seqs:
            if not self._admission_open():
                break
            req = self.waiting[i]
            if req is self._slot_victim:
                i += 1
                continue
            if (urgent or left.prefill <= 0) and not req.urgent:
                break
            hits = self._cached_prefix(req)
            next_key = self._next_uncached_key(req, len(hits))
            if next_key is not None:
                if pending is None:
                    pending = self._pending_keys(self.running)
                # NOTE: shared prefill: the block is being computed now; computing it again would double
                # the work of n fan-out siblings or identical concurrent prompts. Next step it is cached.
                if next_key in pending:
                    i += 1
                    continue
            urgent = req.urgent
            num_computed = req.num_computed_tokens + len(hits) * bm.block_size
            num_new = req.num_tokens - num_computed
            limit = left.tokens if req.urgent else min(left.tokens, left.prefill)
            heavy = not req.urgent and self._heavy is not None and req.tenant in self._heavy
            if heavy:
                limit = min(limit, self._heavy_left)
                if limit <= 0 or (num_new > limit and not chunked):
                    i += 1
                    continue
            if num_new > limit:
                if not chunked:
                    break
                num_new = limit
            need = bm.blocks_for_tokens(num_computed + num_new) - len(req.block_table) - len(hits)
            if need > (bm.num_free_after_taking(hits) if hits else bm.num_free_blocks):
                break
            del self.waiting[i]
            self._admit(req, hits, num_computed, need)
            if pending is not None:
                pending |= self._pending_keys([req])
            samples = req.num_computed_tokens + num_new == req.num_tokens
            out.chunks.append(ScheduledChunk(req, num_new, samples))
            left.tokens -= num_new
            left.prefill -= num_new
            if heavy:
                self._heavy_left -= num_new

    def _admit(self, req: Request, hits: list[int], num_computed: int, need: int) -> None:
        """Move `req` from waiting to running with its cached blocks `hits` and `need` new ones."""
        bm = self.block_manager
        if hits:
            bm.take(hits)
            req.block_table = hits
            req.num_computed_tokens, req.num_registered_blocks = num_computed, len(hits)
        req.num_cached_tokens = len(hits) * bm.block_size
        self.num_cached_tokens += req.num_cached_tokens
        if self.config.batching != "continuous":
            self._batch_quota -= 1
        if need > 0:
            # A prefill-only request's blocks are sent to a decode worker: as one run of ids they
            # go on the wire straight from the cache, with no packing copy (kv_transfer.protocol).
            run = bm.allocate_contiguous(need) if req.prefill_only and not req.block_table else None
            req.block_table.extend(run or bm.allocate(need))
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self.fair_clock.started(req)

    def _next_uncached_key(self, req: Request, num_hits: int) -> bytes | None:
        """The key of the first full prompt block of `req` (starting from nothing) the prefix cache does
        not hold, or None when there is none or `req` does not read the cache."""
        if not self._reads_cache(req):
            return None
        bs = self.block_manager.block_size
        n = (req.num_tokens - 1) // bs
        return req.full_block_keys(n, bs)[num_hits] if num_hits < n else None

    def _pending_keys(self, requests: list[Request]) -> set[bytes]:
        """Keys of the full blocks that `requests` still in prefill will compute and register."""
        bs = self.block_manager.block_size
        keys: set[bytes] = set()
        for r in requests:
            full = r.num_tokens // bs
            if r.num_tokens - r.num_computed_tokens > 1 and full > r.num_registered_blocks:
                keys.update(r.full_block_keys(full, bs)[r.num_registered_blocks:])
        return keys

    def _add_drafts(self, out: SchedulerOutput, left: _Budget) -> None:
        """Extend decode chunks by their request's drafts (`Request.spec_token_ids`), in priority order,
        as far as the token budget and the free blocks allow.

        NOTE: drafts come last and never preempt: they only use what every committed token of this
        step (decodes, prompt chunks) left over, so speculation cannot slow anyone else down."""
        bm = self.block_manager
        for chunk in out.chunks:
            if left.tokens <= 0:
                break
            req = chunk.request
            k = min(len(req.spec_token_ids), left.tokens)
            if k == 0 or chunk.num_new_tokens != 1 or not chunk.samples:
                continue
            have = len(req.block_table)
            while k > 0 and bm.blocks_for_tokens(req.num_computed_tokens + 1 + k) - have > bm.num_free_blocks:
                k -= 1
            need = bm.blocks_for_tokens(req.num_computed_tokens + 1 + k) - have
            if need > 0:
                req.block_table.extend(bm.allocate(need))
            chunk.num_new_tokens += k
            chunk.num_spec = k
            left.tokens -= k

    def _reads_cache(self, req: Request) -> bool:
        """Whether `req` may take its first blocks from the prefix cache. A request that still wants its
        prompt's logprobs computes every position (a cached block has no logits), as vLLM does."""
        return (self.config.enable_prefix_caching and not req.block_table and not req.num_computed_tokens
                and (req.params.prompt_logprobs is None or req.prompt_logprobs_sent))

    def _cached_prefix(self, req: Request) -> list[int]:
        """Cached blocks holding `req`'s first tokens, for a request starting from nothing. The last
        token is always computed: its logits give the next token."""
        if not self._reads_cache(req):
            return []
        n = (req.num_tokens - 1) // self.block_manager.block_size
        return self.block_manager.lookup(req.full_block_keys(n, self.block_manager.block_size)) if n else []

    def postprocess_chunk(self, chunk: ScheduledChunk) -> None:
        """After a step without drafts for `chunk`: its tokens' KV is computed."""
        assert not chunk.num_spec, "a chunk with drafts is committed by commit_verified"
        chunk.request.num_computed_tokens += chunk.num_new_tokens
        self._register_full_blocks(chunk.request)

    def commit_verified(self, chunk: ScheduledChunk, num_emitted: int) -> None:
        """After verifying `chunk`'s drafts, `num_emitted` tokens were appended to its request (the
        accepted drafts and one token of the model's own). The KV of the chunk's first token and the
        accepted drafts is kept; the blocks that only hold rejected drafts are freed.

        NOTE: rejected drafts' KV may stay in the last kept block, past `num_computed_tokens`: nothing
        reads a slot beyond a sequence's computed length, the next step overwrites it, and a block
        enters the prefix cache only once all of its tokens are computed and committed."""
        req = chunk.request
        assert chunk.num_spec and 1 <= num_emitted <= chunk.num_new_tokens, (chunk.num_spec, num_emitted)
        req.num_computed_tokens += num_emitted
        assert req.num_computed_tokens == req.num_tokens - 1, "verification must leave one token to decode"
        keep = self.block_manager.blocks_for_tokens(req.num_computed_tokens)
        if len(req.block_table) > keep:
            self.block_manager.free(req.block_table[keep:])
            del req.block_table[keep:]
        self._register_full_blocks(req)

    def _register_full_blocks(self, req: Request) -> None:
        """Put `req`'s newly full, computed blocks in the prefix cache."""
        if self.config.enable_prefix_caching:
            bm = self.block_manager
            full = req.num_computed_tokens // bm.block_size
            if full > req.num_registered_blocks:
                keys = req.full_block_keys(full, bm.block_size)
                for i in range(req.num_registered_blocks, full):
                    bm.register(req.block_table[i], keys[i])
                req.num_registered_blocks = full

    def check_integrity(self) -> None:
        """Raise AssertionError on a leaked or half-owned KV block (call it between steps): each block a
        request holds has at least as many references as holders (a cached prefix block is shared; an
        exported copy's pin adds one), no waiting request holds one, and no running request holds more
        than its computed tokens and its next one need (a rejected draft's block never outlives its step)."""
        bm = self.block_manager
        bm.check_integrity()
        holders = Counter(b for r in self.running + list(self.prefilled.values()) for b in r.block_table)
        for b, n in holders.items():
            assert bm.ref_count(b) >= n, f"KV block {b} is held by {n} requests but has {bm.ref_count(b)} references"
        for r in self.running:
            assert len(r.block_table) <= bm.blocks_for_tokens(r.num_computed_tokens + 1), (
                f"running request {r.request_id} holds {len(r.block_table)} blocks for "
                f"{r.num_computed_tokens} computed tokens")
        for r in self.waiting:
            assert not r.block_table, f"waiting request {r.request_id} holds blocks"
