"""The worker pools' sizes: naming, autoscaling by queue depth, draining, replacement, and moving
queued prompts between prefill workers. Plain bookkeeping on `RouterState`: it decides and returns the
workers to start or close; the router actor starts, closes and kills them.

    every autoscale_interval_s: tick() ─▶ scale up (new views to start) / drain the least loaded
                                finished_drains() ─▶ drained workers to close
                                rebalance_plan() ─▶ release queued prompts from one prefill worker,
                                rebalanced() ─▶ ... and queue them on another
    a worker died: refill() after its moved sequences settled ─▶ new views to start
"""

from __future__ import annotations

import enum
import logging
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, NamedTuple

from deployments.cluster.actions import Action
from deployments.cluster.messages import GenRequest, Role
from deployments.cluster.placement import Placement
from deployments.cluster.state import RouterState, Stage, WorkerView
from deployments.config import ServeConfig

logger = logging.getLogger(__name__)

# Workers are detached named actors `pdserve-<role>-<index>`: a restarted router finds them by name.
WORKER_PREFIX = "pdserve-"


def worker_name(role: Role, index: int) -> str:
    return f"{WORKER_PREFIX}{role.value}-{index}"


def parse_worker_name(name: str) -> tuple[Role, int] | None:
    """(role, index) of a worker actor's name, None if it does not name one."""
    if not name.startswith(WORKER_PREFIX):
        return None
    role, _, index = name.removeprefix(WORKER_PREFIX).rpartition("-")
    try:
        return Role(role), int(index)
    except ValueError:
        return None


class PoolSize(NamedTuple):
    initial: int
    min: int
    max: int


def pool_size(config: ServeConfig, role: Role) -> PoolSize:
    """A pool's start size and autoscaling bounds (a bound left unset is the start size)."""
    if role is Role.PREFILL:
        n, lo, hi = config.num_prefill_workers, config.prefill_min_workers, config.prefill_max_workers
    else:
        n, lo, hi = config.num_decode_workers, config.decode_min_workers, config.decode_max_workers
    return PoolSize(n, n if lo is None else lo, n if hi is None else hi)


class PoolAction(str, enum.Enum):
    SCALE_UP = "scale_up"
    SCALE_DOWN = "scale_down"  # the least loaded worker drains, then closes
    REPLACE = "replace"  # a worker died
    DRAINED = "drained"  # a draining worker died


class PoolDecision(NamedTuple):
    time: float
    pool: Role
    action: PoolAction
    from_size: int
    to_size: int
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return {"time": self.time, "pool": self.pool.value, "action": self.action.value, "from": self.from_size,
                "to": self.to_size, "reason": self.reason}


@dataclass(slots=True)
class ScaleState:
    desired: int = 0
    reason: str = ""
    signal_since: float | None = None  # when the current signal (up, down or hold) began
    signal_dir: int = 0  # +1 up, -1 down, 0 hold


class Rebalance(NamedTuple):
    """Move not-yet-started prompts, up to `max_tokens`, from prefill worker `src` to `dst`."""

    src: WorkerView
    dst: WorkerView
    max_tokens: int


class Pools:
    def __init__(self, config: ServeConfig, state: RouterState, placement: Placement):
        self.config = config
        self.state = state
        self.placement = placement
        self.scale = {r: ScaleState() for r in Role}
        self.replacing = {r: 0 for r in Role}  # dead workers whose replacement is pending
        self.decisions: deque[PoolDecision] = deque(maxlen=100)
        self._next_index = {r: 0 for r in Role}

    # ------------------------------------------------------------------ members
    def new_worker(self, role: Role) -> WorkerView:
        """A view for a worker about to be started, in its pool from now on."""
        w = WorkerView(worker_name(role, self._next_index[role]), role)
        self._next_index[role] += 1
        self.state.pools[role][w.worker_id] = w
        return w

    def adopt(self, name: str, role: Role, index: int) -> WorkerView:
        """A worker a previous router incarnation started (`name` parses to `role`, `index`)."""
        w = WorkerView(name, role)
        self.state.pools[role][name] = w
        self._next_index[role] = max(self._next_index[role], index + 1)
        return w

    def fill(self) -> list[WorkerView]:
        """At startup: new workers up to each pool's start size (adopted ones count)."""
        return [self.new_worker(r) for r in Role
                for _ in range(pool_size(self.config, r).initial - len(self.state.pools[r]))]

    def refill(self, role: Role) -> list[WorkerView]:
        """After a death: new workers up to the pool's minimum, or the autoscaler's wish if larger."""
        want = max(pool_size(self.config, role).min, self.scale[role].desired)
        return [self.new_worker(role) for _ in range(want - len(self.state.pools[role]))]

    def record(self, role: Role, action: PoolAction, frm: int, to: int, reason: str) -> None:
        self.decisions.append(PoolDecision(time.time(), role, action, frm, to, reason))
        logger.info("autoscale %s: %s %d -> %d (%s)", role.value, action.value, frm, to, reason)

    # ------------------------------------------------------------------ autoscaling
    def desired(self, role: Role) -> tuple[int, str]:
        """The pool size its queue asks for, within its bounds, and why."""
        c = self.config
        lo, hi = self.bounds(role)
        active = [w for w in self.state.pools[role].values() if not w.leaving]
        n = len(active)
        if role is Role.PREFILL:
            queued = sum(w.queued_prompt_tokens for w in active) + sum(
                len(self.state.tracked[r].req.prompt_token_ids) for r in self.state.unplaced if r in self.state.tracked)
            want = math.ceil(queued / c.prefill_target_queued_tokens)
            reason = f"{queued} queued prompt tokens, target {c.prefill_target_queued_tokens}/worker"
            ttft = self._p90(self.state.latencies.ttft)
            if c.ttft_target_ms is not None and ttft is not None:
                reason += f", TTFT p90 {ttft * 1000:.0f} ms (target {c.ttft_target_ms:g})"
                if ttft * 1000 > c.ttft_target_ms:
                    want = max(want, n + 1)
        else:
            waiting = len(self.state.pending_decode)
            reports = [w.report for w in active if w.report is not None]
            use = (sum(1 - r.num_free_blocks / r.num_total_blocks for r in reports) / len(reports)) if reports else 0.0
            running = sum(r.num_running for r in reports)
            if waiting > c.decode_target_waiting * max(n, 1) or use > c.decode_target_kv_use:
                want = n + 1
            elif waiting == 0 and n > 1 and use * n / (n - 1) < c.decode_target_kv_use / 2 and \
                    running <= c.engine.max_num_seqs * (n - 1) // 2:
                want = n - 1
            else:
                want = n
            reason = f"{waiting} waiting for a slot, KV use {use:.0%}, {running} running"
            step = self._p90(self.state.latencies.steps)
            if c.tpot_target_ms is not None and step is not None:
                reason += f", step p90 {step * 1000:.0f} ms (TPOT target {c.tpot_target_ms:g})"
                if step * 1000 > c.tpot_target_ms:
                    want = max(want, n + 1)
        return max(lo, min(hi, want)), reason

    def _p90(self, samples) -> float | None:
        return self.state.latencies.p90(samples, time.time() - self.config.role_switch_window_s)

    def bounds(self, role: Role) -> tuple[int, int]:
        """The sizes autoscaling may take `role`'s pool to. With role switching, workers move between the
        pools, so the bounds hold for the two pools together: a pool may shrink while both together
        stay above their minimums, and grow while both together stay within their maximums (on a
        fixed cluster, min = max: only switches change the split, and autoscaling never kills a worker
        that a switch moved)."""
        size = pool_size(self.config, role)
        if not self.config.role_switching:
            return size.min, size.max
        n = sum(1 for w in self.state.pools[role].values() if not w.leaving)
        total = sum(1 for w in self.state.workers() if not w.draining)
        floor = sum(pool_size(self.config, r).min for r in Role)
        ceil = sum(pool_size(self.config, r).max for r in Role)
        return max(1, n - max(0, total - floor)), n + max(0, ceil - total)

    def tick(self, now: float, hold: frozenset[Role] = frozenset()) -> list[WorkerView]:
        """One autoscaling round: a signal that held long enough scales its pool up (the new workers'
        views are returned, to be started) or drains its least loaded worker. A pool in `hold` is not
        scaled up this round (a worker is switching to it: switching comes first)."""
        c = self.config
        started: list[WorkerView] = []
        for role in Role:
            st = self.scale[role]
            active = [w for w in self.state.pools[role].values() if not w.leaving]
            want, reason = self.desired(role)
            st.desired, st.reason = want, reason
            direction = (want > len(active)) - (want < len(active))
            if direction != st.signal_dir:
                st.signal_dir, st.signal_since = direction, now
            held = now - (st.signal_since or now)
            if direction > 0 and held >= c.upscale_delay_s and not self.replacing[role] and role not in hold:
                self.record(role, PoolAction.SCALE_UP, len(active), want, reason)
                self.state.counters.scale_ups += 1
                started += [self.new_worker(role) for _ in range(want - len(active))]
                st.signal_dir, st.signal_since = 0, now
            elif direction < 0 and held >= c.downscale_delay_s:
                victim = min(active, key=self.state.load)
                victim.draining = True
                self.record(role, PoolAction.SCALE_DOWN, len(active), len(active) - 1,
                            reason + f"; draining {victim.worker_id}")
                self.state.counters.scale_downs += 1
                st.signal_dir, st.signal_since = 0, now
        return started

    def finished_drains(self) -> list[WorkerView]:
        """A draining worker takes no new work; once nothing of it is tracked it leaves its pool, and
        the caller closes it."""
        done = [w for w in self.state.workers() if w.draining and self.state.load(w) == 0]
        for w in done:
            self.state.remove_worker(w)
        return done

    # ------------------------------------------------------------------ prefill queues
    def rebalance_plan(self) -> Rebalance | None:
        """Requests are placed on a prefill worker when they arrive; when one worker's queue runs more
        than two steps ahead of another's (a worker just joined after a burst, or one is draining),
        move not-yet-started requests from the longest queue to the shortest."""
        ready = [w for w in self.state.prefill.values() if w.ready]
        takers = [w for w in ready if not w.draining]
        if len(ready) < 2 or not takers:
            return None
        src = max(ready, key=lambda w: (w.leaving, w.queued_prompt_tokens))
        dst = min(takers, key=lambda w: w.queued_prompt_tokens)
        gap = src.queued_prompt_tokens - dst.queued_prompt_tokens
        if src is dst or (gap <= 2 * self.config.engine.max_num_batched_tokens and
                          not (src.leaving and src.queued_prompt_tokens)):
            return None
        # A draining (or role-changing) worker hands over everything not started; otherwise split the difference.
        want = src.queued_prompt_tokens if src.leaving else gap // 2
        return Rebalance(src, dst, max(1, want))

    def rebalanced(self, plan: Rebalance, reqs: list[GenRequest]) -> list[Action]:
        """`plan.src` released `reqs` (its newest queued prompts): queue them on `plan.dst`."""
        dst_alive = self.state.prefill.get(plan.dst.worker_id) is plan.dst
        actions: list[Action] = []
        moved = 0
        for req in reqs:
            t = self.state.tracked.get(req.request_id)
            if t is None or t.stage is not Stage.PREFILL or t.worker_id != plan.src.worker_id:
                continue  # aborted meanwhile
            self.placement.prefill_done(t)
            if dst_alive:
                actions.append(self.placement.send_to_prefill(t, plan.dst))
            else:  # it died while `src` released them
                actions += self.placement.place_prefill(t, allow_local=False)
            moved += 1
        if moved:
            self.state.counters.rebalanced += moved
            logger.info("moved %d queued prompts from %s to %s", moved, plan.src.worker_id, plan.dst.worker_id)
        return actions

    # ------------------------------------------------------------------ introspection
    def describe(self, role: Role) -> dict[str, Any]:
        pool, size, st = self.state.pools[role], pool_size(self.config, role), self.scale[role]
        return {"size": len(pool), "ready": sum(w.ready for w in pool.values()),
                "draining": sum(w.draining for w in pool.values()), "min": size.min, "max": size.max,
                "desired": st.desired, "signal": st.reason}
