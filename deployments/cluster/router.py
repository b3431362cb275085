"""The router: one Ray actor that owns the worker pools and decides where each request goes.

    submit ─▶ prefill worker (least prompt tokens to compute: its queue + the uncached part)
                 │ on_prefilled(KVHandle)
                 ▼
    pending-decode queue ─▶ decode worker with room (after every step report)

Colocated (num_prefill_workers=0), submit puts requests straight in the pending-decode queue and the
decode worker runs them whole (`DecodeWorker.resume`), chunked prefill mixed into its batch.

It is off the per-token path: tokens go from workers to the ingress's StreamHub. It sees one
`DecodeReport` per decode worker per step and fills freed capacity at once, which is continuous
batching across the whole decode pool.

This actor is thin: it owns the state (`RouterState`) and the workers' Ray handles, wires three plain
parts that decide, and makes the Ray calls they ask for (`Action`s, in `_do`):
- `Placement` (placement.py): prefill choice (prefix-aware, conditional local prefill), decode
  admission, where a dead decode worker's sequences go;
- `Pools` (pools.py): autoscaling by queue depth, draining, replacement, prefill-queue rebalancing;
- `Recovery` (recovery.py): a dead worker's requests retried or moved (from the tokens their clients
  already have), and a restarted router's state rebuilt. Workers are detached named actors, so a
  restarted router adopts them and rebuilds its state from their snapshots.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import Any

import ray

from deployments import metrics, tracing
from deployments.cluster.traces import RouterTraces
from deployments.cluster.decode_worker import DecodeWorker
from deployments.cluster.introspect import router_stats
from deployments.cluster.messages import DecodeReport, GenRequest, ModelInfo, Role, SubmitResult
from deployments.cluster.placement import Placement
from deployments.cluster.pools import WORKER_PREFIX, PoolAction, Pools, parse_worker_name
from deployments.cluster.prefill_worker import PrefillWorker
from deployments.cluster.prefix_index import PrefixIndex
from deployments.cluster.recovery import Lost, MovedSettling, Recovery, Requeue
from deployments.cluster.role_worker import RoleWorker
from deployments.cluster.roles import RoleController
from deployments.cluster.router_calls import RouterCalls
from deployments.cluster.state import RouterState, Stage, Tracked, WorkerView
from deployments.cluster.tp_ranks import create_placement_group, remove_worker_placement_group, scheduling
from deployments.config import ServeConfig
from kv_transfer import KVHandle

__all__ = ["Router", "RouterActor", "WORKER_PREFIX"]

logger = logging.getLogger(__name__)

REPLACE_WAIT_S = 10.0  # longest a dead decode worker's replacement waits for its moved sequences
WORKER_START_TIMEOUT_S = 900.0  # a worker loads its model within this


class Router(RouterCalls):
    """The router actor (`RouterActor`). Its API: the ingress calls `wait_ready`, `submit`, `abort`,
    `stats`; workers call `on_prefilled`, `on_finished`, `report_decode`, `on_kv_backup`; tests and
    tools call `workers`, `check_integrity`, `shutdown`."""

    def __init__(self, config: ServeConfig):
        self.config = config
        # The pools' and roles' decisions are rare and are what an operator reads the router's log for:
        # at INFO, above Ray's WARNING default for a worker process (PDSERVE_LOG_LEVEL overrides).
        for name in (__name__, "deployments.cluster.pools", "deployments.cluster.roles"):
            logging.getLogger(name).setLevel(os.environ.get("PDSERVE_LOG_LEVEL", "INFO"))
        ctx = ray.get_runtime_context()
        self.me, self.namespace = ctx.current_actor, ctx.namespace
        # Tracked requests, worker views, counters, and the prefix index: which prompt blocks each
        # worker computed lately, i.e. where a prompt's prefix is likely cached.
        self.state = RouterState(PrefixIndex(config.engine.block_size))
        self.placement = Placement(config, self.state)
        self.pools = Pools(config, self.state, self.placement)
        self.recovery = Recovery(config, self.state, self.placement)
        self.roles = RoleController(config, self.state)  # `--role-switching` (roles.py)
        self.actors: dict[str, Any] = {}  # worker id -> its actor handle, while it is in a pool
        tracing.configure(config.otlp_endpoint, config.trace_exporter, "pdserve-router")
        self.traces = RouterTraces(config.local_prefill_max_tokens, config.colocated)
        self._ready = asyncio.Event()
        self._startup_error: str | None = None
        self._tasks = [asyncio.get_event_loop().create_task(self._start())]

    # ------------------------------------------------------------------ startup / adoption
    async def _start(self) -> None:
        try:
            adopted = self._adopt_existing()
            for w in self.pools.fill():
                self._start_worker(w)
            await asyncio.wait_for(asyncio.gather(*[self._until_ready(w) for w in self.state.workers()]),
                                   WORKER_START_TIMEOUT_S)
            if adopted:
                await self._rebuild()
        except Exception as exc:  # noqa: BLE001
            self._startup_error = repr(exc)
            logger.exception("router startup failed")
        self._ready.set()
        loop = asyncio.get_event_loop()
        self._tasks += [loop.create_task(self._monitor()), loop.create_task(self._autoscale())]

    def _adopt_existing(self) -> bool:
        """A restarted router finds the workers its predecessor left (they are detached)."""
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a.get("namespace") == self.namespace and a["name"].startswith(WORKER_PREFIX)]
        for name in names:
            parsed = parse_worker_name(name)
            if parsed is None:
                continue
            try:
                self.actors[name] = ray.get_actor(name, namespace=self.namespace)
            except ValueError:
                continue
            role, index = parsed
            if self.config.role_switching:  # its name says the role it started in, not the one it has now
                try:
                    role = ray.get(self.actors[name].current_role.remote(), timeout=30)
                except Exception:  # noqa: BLE001 - dead or not a RoleWorker: the monitor deals with it
                    pass
            self.pools.adopt(name, role, index)
        return bool(names)

    async def _rebuild(self) -> None:
        snapshots = {}
        for w in self.state.workers():
            try:
                snapshots[w.worker_id] = await asyncio.wait_for(self.actors[w.worker_id].snapshot.remote(), 30)
            except Exception:  # noqa: BLE001 - it died meanwhile; the monitor will notice
                continue
        self._do(self.recovery.rebuild(snapshots))

    def _start_worker(self, w: WorkerView) -> WorkerView:
        c = self.config
        cls, resources = (PrefillWorker, c.prefill_resources) if w.role is Role.PREFILL else \
            (DecodeWorker, c.decode_resources)
        args = (w.worker_id, c, self.me)
        if c.role_switching:  # every worker can take either role (role_worker.py)
            cls, args = RoleWorker, (*args, w.role)
        # A tensor-parallel worker: a placement group of one bundle per rank, the worker in bundle 0
        # (it starts the other ranks in the others: tp_ranks.py). TP 1: placed as any actor.
        pg = create_placement_group(w.worker_id, c, w.role.value, dict(resources))
        self.actors[w.worker_id] = cls.options(
            name=w.worker_id, namespace=self.namespace, lifetime="detached", num_cpus=c.worker_num_cpus,
            num_gpus=c.worker_num_gpus, resources=dict(resources) or None,
            **scheduling(pg, 0)).remote(*args)
        return w

    def _kill_worker(self, worker_id: str, actor: Any) -> None:
        """End a worker actor and, for a tensor-parallel one, its placement group (and the ranks in it)."""
        with contextlib.suppress(Exception):  # already dead
            ray.kill(actor)
        if max(self.config.prefill_tp, self.config.decode_tp) > 1:
            remove_worker_placement_group(worker_id)

    async def _until_ready(self, w: WorkerView) -> None:
        w.info = await asyncio.wait_for(self.actors[w.worker_id].info.remote(), WORKER_START_TIMEOUT_S)
        if self.config.routes_by_prefix:
            self.state.prefix_index.add_worker(w.worker_id, w.info.num_blocks)
        await self._open_kv_channels(w)
        w.ready, w.ready_at = True, time.time()
        asyncio.get_event_loop().create_task(self._watch(w))
        self._do(self.placement.flush_unplaced())
        self._do(self.placement.admit())

    async def _open_kv_channels(self, w: WorkerView) -> None:
        """Before a worker takes work, open its KV channels to the other pool's ready workers: otherwise
        the first sequence handed over between a new pair waits for the rendezvous, a stall its client
        sees (measured at seconds on a busy 2-core node, right when a replacement joins)."""
        if w.role is Role.DECODE:
            pairs = [(w.worker_id, p.worker_id) for p in self.state.prefill.values() if p.ready]
        else:
            pairs = [(d.worker_id, w.worker_id) for d in self.state.decode.values() if d.ready]
        if not pairs:
            return
        a = self.actors
        calls = [a[d].connect_kv.remote(p, a[p]) for d, p in pairs]
        if self.config.backs_up_kv:  # the other way: prefill workers pull copies of local prefills
            calls += [a[p].connect_kv.remote(d, a[d]) for d, p in pairs]
        try:
            await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True),
                                   self.config.kv_transfer_timeout_s)
        except asyncio.TimeoutError:
            logger.warning("opening KV channels for %s timed out; the first pulls will open them", w.worker_id)

    async def _watch(self, w: WorkerView) -> None:
        """Notice a worker's death the moment Ray does (a call in flight on it fails), not at the next
        ping: the sooner its sequences move, the shorter the stall their clients see."""
        actor = self.actors[w.worker_id]
        while self.state.pools[w.role].get(w.worker_id) is w:
            try:
                if await actor.watch.remote(300.0):
                    return  # closed after a drain
            except ray.exceptions.RayActorError as exc:
                if self.state.pools[w.role].get(w.worker_id) is w:
                    await self._on_worker_dead(w, repr(exc))
                return
            except Exception:  # noqa: BLE001 - e.g. a transient RPC error: the pings still watch it
                await asyncio.sleep(1.0)

    async def wait_ready(self, timeout_s: float = 900.0) -> ModelInfo:
        """Blocks until the first workers loaded their model; returns what the ingress needs to know."""
        await asyncio.wait_for(self._ready.wait(), timeout_s)
        if self._startup_error:
            raise RuntimeError(f"pdserve workers failed to start: {self._startup_error}")
        return next(w.info.model for w in self.state.workers() if w.ready and w.info is not None)

    # ------------------------------------------------------------------ requests and worker callbacks
    async def submit(self, req: GenRequest) -> SubmitResult:
        """Queue `req`; refused when the queue is full (the caller answers 429)."""
        s = self.state
        if s.early_aborts.take(req.request_id):  # its client left, and said so before this arrived
            s.counters.aborted += 1
            return SubmitResult(False, 0.0, "aborted by its client before it arrived")
        if s.num_queued() >= self.config.max_queued_requests:
            s.counters.rejected += 1
            metrics.count_rejected()
            return SubmitResult(False, 1.0, f"{s.num_queued()} requests queued (max_queued_requests)")
        s.counters.submitted += 1
        metrics.count_submitted()
        req.arrival_time = req.arrival_time or time.time()
        t = s.tracked[req.request_id] = Tracked(req, req.params, Stage.UNPLACED)
        self._do(self.placement.place_prefill(t))
        return SubmitResult(True)

    async def on_prefilled(self, worker_id: str, request_id: str, handle: KVHandle) -> None:
        if (t := self.state.tracked.get(request_id)) is not None:
            self.traces.prefilled(t.req)
            if t.req.offset == 0 and t.req.arrival_time:
                self.state.latencies.record_ttft(time.time() - t.req.arrival_time)
        self._do(self.placement.prefilled(worker_id, request_id, handle))

    async def on_finished(self, worker_id: str, request_id: str) -> None:
        self.placement.finished(worker_id, request_id)

    async def report_decode(self, report: DecodeReport) -> None:
        if report.step_s and report.num_running:
            self.state.latencies.record_step(report.step_s)
        self._do(self.placement.reported(report))

    async def on_kv_backup(self, worker_id: str, request_id: str, num_tokens: int, copied_tokens: int) -> None:
        """Prefill worker `worker_id` has `request_id`'s first `num_tokens` tokens of KV cached, the last
        `copied_tokens` of them just copied from a decode worker."""
        self.placement.record_backup(worker_id, request_id, num_tokens, copied_tokens)

    async def abort(self, request_id: str) -> None:
        self.traces.forget(request_id)
        self._do(self.placement.abort(request_id))

    # ------------------------------------------------------------------ failures
    async def _monitor(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            s = self.state
            metrics.set_pool_state(Role.PREFILL.value, s.num_waiting_prefill(), len(s.prefill))
            metrics.set_pool_state(Role.DECODE.value, len(s.pending_decode), len(s.decode))
            workers = [w for w in s.workers() if w.ready]
            results = await asyncio.gather(*[asyncio.wait_for(self.actors[w.worker_id].ping.remote(),
                                                              self.config.health_check_timeout_s)
                                             for w in workers], return_exceptions=True)
            for w, r in zip(workers, results):
                if isinstance(r, (ray.exceptions.RayActorError, asyncio.TimeoutError)):
                    await self._on_worker_dead(w, repr(r))

    async def _on_worker_dead(self, w: WorkerView, why: str) -> None:
        if not self.state.remove_worker(w):
            return
        actor = self.actors.pop(w.worker_id)
        self._forget_peer(w.worker_id)
        self.state.counters.worker_deaths += 1
        metrics.count_worker_death(w.role.value)
        logger.warning("%s died (%s); moving its requests", w.worker_id, why)
        n = len(self.state.pools[w.role])
        self.pools.record(w.role, PoolAction.DRAINED if w.draining else PoolAction.REPLACE, n + 1, n,
                          f"{w.worker_id} died")
        self._kill_worker(w.worker_id, actor)
        lost = self.recovery.lost_on(w)
        # The clients' tokens, fetched at once: a moved sequence recomputes its prompt plus these.
        delivered = await asyncio.gather(*[self._delivered(t.req) for t, _ in lost])
        actions, moving = self.recovery.relocate(lost, delivered, f"{w.worker_id} died")
        self._do(actions)
        moved = [t for t, kind in lost if kind is Requeue.MIGRATION]
        if len(moved) > 1:
            logger.info("moved %s's sequences: recompute tokens by destination %s", w.worker_id, moving.tokens)
        self.pools.replacing[w.role] += 1
        asyncio.get_event_loop().create_task(self._replace(w.role, moved))

    async def _replace(self, role: Role, moved: list[Tracked]) -> None:
        """Bring `role`'s pool back to its size, once the sequences `moved` off a dead worker have been
        recomputed (or REPLACE_WAIT_S passed): a new worker loading its model takes CPU (on a CPU node,
        the very cores) the survivors need for that recompute, and every client of a moved sequence
        is stalled until it is done. On GPUs the recompute takes milliseconds, so this costs nothing."""
        try:
            if any(w.takes_work for w in self.state.pools[role].values()):  # else nowhere to go
                settling = MovedSettling(self.state, moved)
                deadline = time.monotonic() + REPLACE_WAIT_S
                while moved and time.monotonic() < deadline and settling.waiting():
                    await asyncio.sleep(0.05)
        finally:
            self.pools.replacing[role] -= 1
        for w in self.pools.refill(role):
            asyncio.get_event_loop().create_task(self._bring_up(self._start_worker(w)))

    async def _bring_up(self, w: WorkerView, attempt: int = 0) -> None:
        """A new worker (replacement, scale-up) that never starts (its node died under it, its model
        failed to load) leaves the pool and is replaced after a backoff, instead of holding a place
        in the pool as not ready for good."""
        try:
            await self._until_ready(w)
        except (ray.exceptions.RayActorError, asyncio.TimeoutError) as exc:
            if not self.state.remove_worker(w):
                return
            self._kill_worker(w.worker_id, self.actors.pop(w.worker_id))
            self._forget_peer(w.worker_id)
            n = len(self.state.pools[w.role])
            self.pools.record(w.role, PoolAction.REPLACE, n + 1, n, f"{w.worker_id} failed to start: {exc!r:.200}")
            await asyncio.sleep(min(30.0, 2.0 * 2 ** attempt))
            for nw in self.pools.refill(w.role):
                asyncio.get_event_loop().create_task(self._bring_up(self._start_worker(nw), attempt + 1))

    # ------------------------------------------------------------------ pools
    async def _autoscale(self) -> None:
        while True:
            await asyncio.sleep(self.config.autoscale_interval_s)
            if self.config.role_switching:
                try:
                    await self._switch_roles()
                except Exception:  # noqa: BLE001 - the next round tries again; autoscaling goes on
                    logger.exception("role switching failed this round")
            for w in self.pools.tick(time.time(), self.roles.hold() if self.config.role_switching else frozenset()):
                asyncio.get_event_loop().create_task(self._bring_up(self._start_worker(w)))
            for w in self.pools.finished_drains():
                actor = self.actors.pop(w.worker_id)
                self._forget_peer(w.worker_id)
                try:
                    await asyncio.wait_for(actor.close.remote(), 10)
                except Exception:  # noqa: BLE001
                    pass
                self._kill_worker(w.worker_id, actor)
            await self._rebalance_prefill()

    # ------------------------------------------------------------------ roles (roles.py)
    async def _switch_roles(self) -> None:
        """One round of the role controller: maybe begin a switch, and move each switching worker on
        (hand on what it holds of its old role; once nothing is left, give it the new role)."""
        now = time.time()
        plan = self.roles.tick(now)
        if plan is not None:
            w, to, reason = plan
            d = self.roles.begin(w, to, reason, now)
            metrics.count_role_switch(d.from_role, d.to_role)
        for w in self.roles.switching():
            if self.state.worker(w.worker_id) is not w or not w.ready:
                continue
            if w.role is Role.DECODE and now - (w.switch_since or now) >= self.config.role_switch_drain_s:
                await self._hand_on(w)
            if self.roles.old_role_work(w) == 0:
                await self._complete_switch(w)

    async def switch_role(self, worker_id: str, role: str, reason: str = "asked") -> dict[str, Any]:
        """Begin moving worker `worker_id` to `role` ("prefill", "decode" or "mixed": a decode worker that
        also runs prompts of any length whole) now, whatever the controller thinks (an operator's or a
        test's switch; the controller's dwell then counts from it). ValueError, naming the reason, when
        it cannot: role switching off, no such ready worker, already that role or switching, or the last
        worker taking work in its pool."""
        if not self.config.role_switching:
            raise ValueError("role_switching is off")
        mixed = role == "mixed"
        to = Role.DECODE if mixed else Role(role)
        w = self.state.worker(worker_id)
        if w is None or not w.ready:
            raise ValueError(f"no ready worker {worker_id!r}")
        if w.leaving or (w.role is to and w.mixed == mixed):
            raise ValueError(f"{worker_id} is {'mixed' if w.mixed else w.role.value}"
                             + (" and leaving it" if w.leaving else ""))
        now = time.time()
        if w.role is to:  # decode <-> mixed: the same pool, at once
            d = self.roles.set_mixed(w, mixed, reason, now)
            self._do(self.placement.admit())
        else:
            if sum(1 for v in self.state.pools[w.role].values() if v.takes_work) < 2:
                raise ValueError(f"{worker_id} is the last {w.role.value} worker taking work")
            d = self.roles.begin(w, to, reason, now, mixed=mixed)
        metrics.count_role_switch(d.from_role, d.to_role)
        return d.as_dict()

    async def _hand_on(self, w: WorkerView) -> None:
        """A worker leaving the decode role still decodes sequences after `role_switch_drain_s`: move them
        to the other decode workers as a dead worker's are (from the tokens their clients have, so the
        text is unchanged), after ending them there."""
        mine = [t for t in self.state.tracked.values() if t.worker_id == w.worker_id and t.stage is Stage.DECODE]
        if not mine:
            return
        actor = self.actors[w.worker_id]
        await asyncio.gather(*[asyncio.wait_for(actor.abort.remote(t.req.request_id, t.req.attempt), 10)
                               for t in mine], return_exceptions=True)
        lost = [Lost(t, Requeue.MIGRATION) for t in mine
                if self.state.tracked.get(t.req.request_id) is t and t.worker_id == w.worker_id]
        delivered = await asyncio.gather(*[self._delivered(t.req) for t, _ in lost])
        actions, _ = self.recovery.relocate(lost, delivered, f"{w.worker_id} changes role")
        self._do(actions)
        logger.info("role switch: moved %d sequences off %s", len(lost), w.worker_id)

    async def _complete_switch(self, w: WorkerView) -> None:
        to = w.switching_to
        try:
            await asyncio.wait_for(self.actors[w.worker_id].set_role.remote(to), 30)
        except Exception as exc:  # noqa: BLE001 - dead (the monitor moves its work) or busy: next round
            logger.warning("role switch of %s not completed: %r", w.worker_id, exc)
            return
        if self.state.worker(w.worker_id) is not w:
            return  # died meanwhile
        self.roles.complete(w, time.time())
        await self._open_kv_channels(w)
        self._do(self.placement.flush_unplaced())
        self._do(self.placement.admit())

    async def _rebalance_prefill(self) -> None:
        plan = self.pools.rebalance_plan()
        if plan is None:
            return
        try:
            reqs = await asyncio.wait_for(self.actors[plan.src.worker_id].release_queued.remote(plan.max_tokens), 10)
        except Exception:  # noqa: BLE001 - dead or busy: the monitor deals with it
            return
        self._do(self.pools.rebalanced(plan, reqs))

    # ------------------------------------------------------------------ introspection
    async def stats(self) -> dict[str, Any]:
        """Counters, pools, recent scaling decisions and moves, and every worker's view (JSON-able)."""
        return router_stats(self.state, self.pools, self.roles if self.config.role_switching else None)

    async def workers(self) -> dict[str, Any]:
        """Every pooled worker's actor handle, by worker id."""
        return dict(self.actors)

    async def check_integrity(self) -> dict:
        """Runs every live worker's block-manager integrity check; returns their block use."""
        workers = [w for w in self.state.workers() if w.ready]
        res = await asyncio.wait_for(asyncio.gather(*[self.actors[w.worker_id].check_integrity.remote()
                                                      for w in workers]), 60)
        return {w.worker_id: r for w, r in zip(workers, res)}

    async def shutdown(self) -> None:
        for t in self._tasks:
            t.cancel()
        for worker_id, actor in self.actors.items():
            self._kill_worker(worker_id, actor)
        self.actors.clear()
        for pool in self.state.pools.values():
            pool.clear()


# NOTE: restartable: a new incarnation adopts the detached workers and rebuilds from their snapshots;
# calls made while it restarts are retried rather than failed.
RouterActor = ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)(Router)
