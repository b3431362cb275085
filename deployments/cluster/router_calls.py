"""The router actor's Ray calls: `RouterCalls._do` makes the calls that placement, pools and recovery
ask for (`Action`s), and awaits the answers that decide a request's next stage (`answers.py`).

A mixin of `Router` (router.py), which owns what it reads: `config`, `state`, `placement`, `recovery`
and `actors` (worker id -> its Ray handle).
"""

from __future__ import annotations

import asyncio
from typing import Any

import ray

from deployments import metrics
from deployments.cluster.actions import AbortOn, Action, AdmitKV, EndStream, ReleaseKV, RunWhole, ToPrefill
from deployments.cluster.answers import Answer, Outcome, await_answer
from deployments.frontend.hub_wire import HubClient, hub_client
from deployments.cluster.messages import BackupTo, FetchFrom, GenRequest
from deployments.cluster.placement import Placement
from deployments.cluster.recovery import Claim, Recovery, Requeue
from deployments.cluster.state import RouterState, Stage, Tracked, WorkerView
from deployments.cluster.traces import RouterTraces
from deployments.config import ServeConfig

WORKER_CALL_TIMEOUT_S = 300.0  # the longest the router watches a quick call (`add`) for an error


class RouterCalls:
    config: ServeConfig
    state: RouterState
    placement: Placement
    recovery: Recovery
    actors: dict[str, Any]
    traces: RouterTraces

    def _do(self, actions: list[Action]) -> None:
        """Make the calls the plain parts asked for, in order (their bookkeeping is done)."""
        loop = asyncio.get_event_loop()
        for a in actions:
            if isinstance(a, ToPrefill):
                self.traces.placed("prefill", a.tracked, a.worker_id)
                ref = self.actors[a.worker_id].add.remote(a.tracked.req)
                loop.create_task(self._added(a.tracked, a.tracked.req, a.worker_id, ref))
            elif isinstance(a, RunWhole):
                backup = fetch = None
                if a.backup is not None:
                    backup = BackupTo(a.backup.worker_id, self.actors[a.backup.worker_id], a.backup.first_block)
                if a.fetch is not None:
                    fetch = FetchFrom(a.fetch.worker_id, self.actors[a.fetch.worker_id], a.fetch.num_tokens)
                self.traces.placed("whole", a.tracked, a.worker.worker_id,
                                   fetch_tokens=a.fetch.num_tokens if a.fetch else None)
                ref = self.actors[a.worker.worker_id].resume.remote(a.tracked.req, backup, fetch)
                loop.create_task(self._resumed(a, ref))
            elif isinstance(a, AdmitKV):
                self.traces.placed("admit", a.tracked, a.worker.worker_id, prefill_worker=a.prefill_worker_id)
                ref = self.actors[a.worker.worker_id].admit.remote(a.tracked.req, a.tracked.handle,
                                                                   self.actors[a.prefill_worker_id])
                loop.create_task(self._admitted(a, ref))
            elif isinstance(a, EndStream):
                hub_client().push(a.req.hub, [a.event])
            elif isinstance(a, ReleaseKV):
                self.actors[a.worker_id].kv_release.remote(a.request_id, a.epoch)
            elif isinstance(a, AbortOn):
                self.actors[a.worker_id].abort.remote(a.request_id, a.attempt, a.in_flight)
            else:
                raise AssertionError(f"unknown action {a!r}")

    def _forget_peer(self, worker_id: str) -> None:
        """`worker_id` died or left its pool: every other worker closes its KV channels to it."""
        for actor in self.actors.values():
            actor.kv_forget_peer.remote(worker_id)

    def _answer_timeout_s(self) -> float:
        # a fetch of the cached prefix (resume) or a pull (admit): a lease call and a pull, each this long
        return self.config.kv_transfer_timeout_s * 2 + 5

    async def _admitted(self, a: AdmitKV, ref: Any) -> None:
        t, w = a.tracked, a.worker
        ans = await await_answer(ref, self.actors.get(w.worker_id), t.req, self._answer_timeout_s())
        w.unreserve(a.need, ans.accepted, report_seq=ans.report_seq)
        if self._admitting(t, w):
            await self._answered(t, w, ans, Requeue.RETRY)
        self._do(self.placement.admit())

    async def _resumed(self, a: RunWhole, ref: Any) -> None:
        t, w = a.tracked, a.worker
        ans = await await_answer(ref, self.actors.get(w.worker_id), t.req, self._answer_timeout_s())
        w.unreserve(a.need, ans.accepted, a.own, ans.report_seq)
        if self._admitting(t, w):
            await self._answered(t, w, ans, Requeue.MIGRATION)
        self._do(self.placement.admit())

    def _admitting(self, t: Tracked, w: WorkerView) -> bool:
        """`t` still waits for `w`'s answer (not aborted, moved or failed meanwhile)."""
        return self.state.tracked.get(t.req.request_id) is t and t.stage is Stage.ADMITTING and \
            t.worker_id == w.worker_id

    async def _answered(self, t: Tracked, w: WorkerView, ans: Answer, kind: Requeue) -> None:
        """Act on decode worker `w`'s answer about `t` (`answers.Outcome`)."""
        if ans.outcome is Outcome.ACCEPTED:
            t.stage = Stage.DECODE
        elif ans.outcome is Outcome.REFUSED:  # it cannot start: its client hears so at once
            self._do(self.recovery.refused(t, w.worker_id, ans.reason))
        else:
            if kind is Requeue.RETRY:
                self.state.counters.transfer_failures += 1
                metrics.count_transfer_failure()
            await self._requeue(t, f"{w.worker_id}: {ans.outcome.value} {ans.reason}", kind)

    async def _added(self, t: Tracked, req: GenRequest, worker_id: str, ref: Any) -> None:
        """A prefill worker's `add` raised (not a death: the death watch has those): the request cannot
        start there, so it fails at once instead of waiting in the router for a prefill that never
        comes. (The engine's own refusals come back as an error event from the worker.)"""
        try:
            await asyncio.wait_for(ref, WORKER_CALL_TIMEOUT_S)
            if t.req is req:
                t.adding = False  # an abort from now on finds it there (or finds it gone)
        except ray.exceptions.RayTaskError as exc:
            if self.state.tracked.get(req.request_id) is t and t.req is req and t.stage is Stage.PREFILL and \
                    t.worker_id == worker_id:
                self.placement.prefill_done(t)
                self._do([self.recovery.fail(t, f"{worker_id} could not queue it ({type(exc.cause).__name__})"),
                          AbortOn(worker_id, t.req.request_id, t.req.attempt)])
        except Exception:  # noqa: BLE001 - dead (the death watch moves it) or slow (it is queued)
            pass

    async def _requeue(self, t: Tracked, why: str, kind: Requeue) -> None:
        """Place `t` again from its prompt plus every token its client already has."""
        claim = self.recovery.claim(t)
        if claim is Claim.EXHAUSTED:
            self._do([self.recovery.give_up(t, why)])
        if claim is not Claim.GO:
            return
        delivered = await self._delivered(t.req)
        self._do(self.recovery.requeue(t, kind, delivered))

    async def _delivered(self, req: GenRequest) -> list[int] | None:
        """The tokens `req`'s client already has (None: its ingress replica is gone, and so is it)."""
        try:
            return await asyncio.wait_for(asyncio.to_thread(HubClient.delivered, req.hub, req.request_id, 10.0), 12)
        except Exception:  # noqa: BLE001
            return None

