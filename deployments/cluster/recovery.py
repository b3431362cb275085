"""Failures, as plain bookkeeping: a dead worker's requests placed again, a failed transfer retried,
a restarted router's state rebuilt from the workers' snapshots.

    prefill worker dies / KV transfer fails ─▶ RETRY: prefill again (prompt + tokens the client has)
    decode worker dies ─▶ MIGRATION: every sequence placed where its next token comes soonest
                          (`Placement.place_moved`), started streams first, longest first
    router restarts ─▶ it adopts the detached workers; rebuild() from their snapshots

A requeued request's prompt is its original prompt plus every token its client already has (asked from
the client's stream hub by the router actor), so no token is lost or repeated; the actor then brings
the pool back to size once the moved sequences settled (`MovedSettling`).
"""

from __future__ import annotations

import enum
from dataclasses import replace
from typing import NamedTuple

from deployments import metrics
from deployments.cluster.actions import AbortOn, Action, EndStream, ReleaseKV
from deployments.cluster.messages import StreamEvent, WorkerSnapshot
from deployments.cluster.placement import Moves, Placement
from deployments.cluster.state import RouterState, Stage, Tracked, WorkerView
from deployments.config import ServeConfig
from engine.errors import parse_invalid_request

MAX_ATTEMPTS = 6


class Requeue(enum.Enum):
    """Why a request is placed again (the value is its counter's name)."""

    RETRY = "retries"  # prefill again: its prefill worker died or its KV transfer failed
    MIGRATION = "migrations"  # a dead decode worker's sequence


class Claim(enum.Enum):
    """`Recovery.claim`'s answer."""

    GO = "go"  # now requeueing: fetch the client's tokens, then `requeue`
    ALREADY = "already"  # someone else is requeueing it (the death watch and a failed call both saw it)
    EXHAUSTED = "exhausted"  # out of attempts: `give_up`


class Lost(NamedTuple):
    tracked: Tracked
    kind: Requeue


class Recovery:
    def __init__(self, config: ServeConfig, state: RouterState, placement: Placement):
        self.config = config
        self.state = state
        self.placement = placement

    # ------------------------------------------------------------------ router restart
    def rebuild(self, snapshots: dict[str, WorkerSnapshot]) -> list[Action]:
        """Track what the adopted workers hold (by worker id): decoding first (a request both decoding
        and still leased is decoding), then prefilling and prefilled-but-not-pulled."""
        s = self.state
        for wid, snap in snapshots.items():
            for req in snap.decoding:
                s.tracked[req.request_id] = Tracked(req, req.params, Stage.DECODE, worker_id=wid)
        for wid, snap in snapshots.items():
            for req in snap.prefilling:
                if req.request_id not in s.tracked:
                    n = len(req.prompt_token_ids)
                    s.tracked[req.request_id] = Tracked(req, req.params, Stage.PREFILL, worker_id=wid,
                                                        prefill_worker_id=wid, queued_tokens=n)
                    s.prefill[wid].queued_prompt_tokens += n
            for req, handle in snap.leased:
                if req.request_id not in s.tracked:
                    s.tracked[req.request_id] = Tracked(req, req.params, Stage.PENDING_DECODE, handle=handle,
                                                        prefill_worker_id=wid)
                    s.pending_decode.append(req.request_id)
        s.counters.adopted_requests += len(s.tracked)
        return self.placement.admit()

    # ------------------------------------------------------------------ worker death
    def lost_on(self, w: WorkerView) -> list[Lost]:
        """The requests dead worker `w` held, and how each is placed again (by what it held them as,
        not by its role: a worker that changed role may hold work of both)."""
        lost = []
        for t in self.state.tracked.values():
            if t.prefill_worker_id == w.worker_id and t.stage in (Stage.PREFILL, Stage.PENDING_DECODE):
                lost.append(Lost(t, Requeue.RETRY))
            elif t.worker_id == w.worker_id and t.stage in (Stage.ADMITTING, Stage.DECODE):
                lost.append(Lost(t, Requeue.MIGRATION))
        return lost

    @staticmethod
    def move_order(lost: list[Lost], delivered: list[list[int] | None]) -> list[int]:
        """The order to place `lost` in (indices), `delivered[i]` being the tokens `lost[i]`'s client has.

        NOTE: longest recompute first (within a priority), each to the least loaded destination
        (`Placement.place_moved`): the longest-processing-time rule, so the last client to get its
        next token waits for about the longest sequence, not for two long ones on one worker. Placed
        in arrival order, two long sequences could land together (measured: a 1.99 s stall, against
        1.4-1.6 s when they did not). Streams that have started go first: their clients are stalled
        mid-stream, and their recompute is urgent on its worker (`GenRequest.offset` > 0); one still
        waiting for its first token (e.g. a local prefill under way) only keeps its place in the
        queue by its arrival time."""
        return sorted(range(len(lost)), key=lambda i: (
            lost[i].tracked.req.priority,
            not delivered[i],
            -(lost[i].tracked.req.num_original_prompt_tokens + len(delivered[i] or ())),
            lost[i].tracked.req.arrival_time or 0.0))

    def relocate(self, lost: list[Lost], delivered: list[list[int] | None], why: str) -> tuple[list[Action], Moves]:
        """Place a dead worker's requests again (`move_order`); also the tokens each destination got."""
        moving = Moves()
        actions: list[Action] = []
        for i in self.move_order(lost, delivered):
            t, kind = lost[i]
            claim = self.claim(t)
            if claim is Claim.EXHAUSTED:
                actions.append(self.give_up(t, why))
            elif claim is Claim.GO:
                actions += self.requeue(t, kind, delivered[i], moving)
        return actions, moving

    # ------------------------------------------------------------------ requeue
    def claim(self, t: Tracked) -> Claim:
        """Start requeueing `t`, unless that is under way already or it ran out of attempts."""
        if t.stage is Stage.REQUEUEING:
            return Claim.ALREADY
        t.stage = Stage.REQUEUEING
        return Claim.EXHAUSTED if t.req.attempt + 1 >= MAX_ATTEMPTS else Claim.GO

    def give_up(self, t: Tracked, why: str) -> EndStream:
        return self.fail(t, f"gave up after {MAX_ATTEMPTS} attempts: {why}")

    def fail(self, t: Tracked, message: str) -> EndStream:
        """End `t` with an error its client sees."""
        self.state.tracked.pop(t.req.request_id, None)
        self.state.counters.failed += 1
        return EndStream(t.req, StreamEvent(t.req.request_id, t.req.offset, [], True, "error", message))

    def refused(self, t: Tracked, worker_id: str, reason: str) -> list[Action]:
        """Decode worker `worker_id` refused `t` (`answers.Outcome.REFUSED`): it cannot start, so its
        client hears so now. Whatever the attempt left there is aborted, and a lease it was to pull
        is released."""
        rid = t.req.request_id
        actions: list[Action] = [AbortOn(worker_id, rid, t.req.attempt)]
        if t.handle is not None and self.state.worker(t.prefill_worker_id) is not None:
            actions.append(ReleaseKV(t.prefill_worker_id, rid, t.handle.epoch))
        # A refusal naming a field (engine.errors.invalid_request_text) goes to the door as it is: a 400.
        why = reason if parse_invalid_request(reason) else f"{worker_id} refused the request: {reason}"
        return [self.fail(t, why), *actions]

    def requeue(self, t: Tracked, kind: Requeue, delivered: list[int] | None,
                moving: Moves | None = None) -> list[Action]:
        """Place claimed `t` again: prefill (or, moved, recompute) from the prompt plus the tokens its
        client already has (`delivered`; None: its ingress replica is gone, and so is it), then decode
        on. `moving`: the moves placed before this one in the same batch (a dead decode worker's
        sequences), so that they are spread over the survivors and the prefill pool."""
        req = t.req
        rid = req.request_id
        if delivered is None or self.state.tracked.get(rid) is not t:
            self.state.tracked.pop(rid, None)
            return []
        if kind is Requeue.MIGRATION:
            self.state.counters.migrations += 1
        else:
            self.state.counters.retries += 1
        metrics.count_requeue(kind.value)
        n = len(delivered)
        prompt = req.prompt_token_ids[:req.num_original_prompt_tokens] + delivered
        remaining = t.params.max_tokens - n
        if remaining <= 0 or len(prompt) >= self.state.max_model_len():
            self.state.tracked.pop(rid, None)
            return [EndStream(req, StreamEvent(rid, n, [], True, "length",
                                               num_prompt_tokens=req.num_original_prompt_tokens))]
        # The client already has the prompt's logprobs: the resumed prompt (prompt + output) needs none.
        params = replace(t.params, max_tokens=remaining, min_tokens=max(0, t.params.min_tokens - n),
                         prompt_logprobs=None)
        t.req = replace(req, prompt_token_ids=prompt, params=params, offset=n, attempt=req.attempt + 1)
        t.handle = None
        if kind is Requeue.MIGRATION:
            return self.placement.place_moved(t, moving if moving is not None else Moves())
        return self.placement.place_prefill(t, allow_local=False)


class MovedSettling:
    """Whether sequences moved off a dead decode worker have been recomputed: each decodes on its new
    worker and a whole step ran there after it joined (the pool's replacement waits for this)."""

    def __init__(self, state: RouterState, moved: list[Tracked]):
        self.state = state
        self.moved = moved
        self._marks: dict[str, int] = {}  # request id -> its new worker's step count when it joined there

    def waiting(self) -> bool:
        waiting = False
        for t in self.moved:
            rid = t.req.request_id
            if self.state.tracked.get(rid) is not t:
                continue  # finished or aborted
            w = self.state.decode.get(t.worker_id or "")
            if t.stage is not Stage.DECODE or w is None:
                waiting = True
                continue
            self._marks.setdefault(rid, w.num_steps)
            waiting |= w.num_steps < self._marks[rid] + 2
        return waiting
