"""Workers that change role (`--role-switching`): the ratio controller and the switch's bookkeeping, as
plain classes on `RouterState` (the router actor makes the Ray calls: router.py).

    every autoscale_interval_s: RoleController.tick()
        pressure of each side against its targets (prefill: queued prompt tokens, TTFT; decode: slots
        waited for, KV use, step time), from the router's exact state and what it measured lately
        ─▶ one side over its targets while the other would stay under them with one worker less,
           for role_switch_hold_s, and role_switch_dwell_s since the last switch
        ─▶ begin(): that worker takes no new work of its role (`WorkerView.switching_to`)
    the router, each tick, for a switching worker:
        prefill ─▶ decode: its prompts not started go to the other prefill workers (pools.rebalance_plan),
                           the started ones finish; their KV stays leased on it until pulled
        decode ─▶ prefill: its sequences finish, or after role_switch_drain_s move on as a dead
                           worker's would (recovery.relocate), from the tokens their clients have
        nothing of the old role left in flight ─▶ complete(): it joins the other pool

Autoscaling composes with it: a pool a worker is switching to (or that the controller is about to
feed) is not scaled up meanwhile (`hold`); when the other side has nothing to spare, the controller
does nothing and queue-depth autoscaling adds workers as before.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from typing import Any, NamedTuple

from deployments.cluster.messages import Role
from deployments.cluster.state import RouterState, Stage, WorkerView
from deployments.config import ServeConfig

logger = logging.getLogger(__name__)


class Pressure(NamedTuple):
    """Each side's load against its targets: above 1, it misses them. `*_why`: the figures behind it."""

    prefill: float
    decode: float
    prefill_workers: int
    decode_workers: int
    prefill_why: str
    decode_why: str

    def after_losing(self, role: Role) -> float:
        """`role`'s pressure with one worker fewer (its load spread over the rest)."""
        n, p = (self.prefill_workers, self.prefill) if role is Role.PREFILL else (self.decode_workers, self.decode)
        return math.inf if n <= 1 else p * n / (n - 1)


class SwitchDecision(NamedTuple):
    time: float
    worker_id: str
    from_role: str  # a `Role`'s value, or "mixed"
    to_role: str
    reason: str
    completed_at: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"time": self.time, "worker_id": self.worker_id, "from": self.from_role, "to": self.to_role,
                "reason": self.reason, "completed_at": self.completed_at}


def _role_name(w: WorkerView) -> str:
    return "mixed" if w.mixed and w.role is Role.DECODE else w.role.value


class RoleController:
    """Decides which worker changes role, and when (see the module docstring)."""

    def __init__(self, config: ServeConfig, state: RouterState):
        self.config = config
        self.state = state
        self.signal: Role | None = None  # the role the load asks a worker for, while it holds
        self.signal_since: float | None = None
        self.last_switch = -math.inf
        self.decisions: deque[SwitchDecision] = deque(maxlen=100)
        self.last_pressure: Pressure | None = None

    # ------------------------------------------------------------------ the decision
    def pressure(self, now: float) -> Pressure:
        c, s = self.config, self.state
        pre = [w for w in s.prefill.values() if w.takes_work]
        dec = [w for w in s.decode.values() if w.takes_work]
        n_p, n_d = len(pre), len(dec)
        since = now - c.role_switch_window_s
        queued = sum(w.queued_prompt_tokens for w in s.prefill.values()) + sum(
            len(s.tracked[r].req.prompt_token_ids) for r in s.unplaced if r in s.tracked)
        p = queued / (max(n_p, 1) * c.prefill_target_queued_tokens)
        p_why = f"{queued} queued prompt tokens over {n_p} workers (target {c.prefill_target_queued_tokens} each)"
        lat = s.latencies
        ttft = lat.p90(lat.ttft, since)
        if c.ttft_target_ms is not None and ttft is not None:
            p = max(p, ttft * 1000 / c.ttft_target_ms)
            p_why += f", TTFT p90 {ttft * 1000:.0f} ms (target {c.ttft_target_ms:g})"
        waiting = len(s.pending_decode)
        reports = [w.report for w in dec if w.report is not None]
        use = sum(1 - r.num_free_blocks / max(r.num_total_blocks, 1) for r in reports) / len(reports) if reports else 0.0
        running = sum(r.num_running + r.num_waiting for r in reports)
        d = max(waiting / (max(n_d, 1) * c.decode_target_waiting), use / c.decode_target_kv_use)
        d_why = (f"{waiting} waiting for a slot, {running} running on {n_d} workers, KV use {use:.0%} "
                 f"(targets {c.decode_target_waiting} waiting/worker, {c.decode_target_kv_use:.0%})")
        step = lat.p90(lat.steps, since)
        if c.tpot_target_ms is not None and step is not None:
            d = max(d, step * 1000 / c.tpot_target_ms)
            d_why += f", step p90 {step * 1000:.0f} ms (TPOT target {c.tpot_target_ms:g})"
        self.last_pressure = Pressure(p, d, n_p, n_d, p_why, d_why)
        return self.last_pressure

    def wanted(self, pr: Pressure) -> Role | None:
        """The role that should gain a worker now: its side misses its targets, and the other side would
        still meet its own with one worker fewer (and be the less pressed of the two)."""
        for gain, lose, need in ((Role.PREFILL, Role.DECODE, pr.prefill), (Role.DECODE, Role.PREFILL, pr.decode)):
            left = pr.after_losing(lose)
            if need > 1.0 and left < 1.0 and left < need:
                return gain
        return None

    def switching(self) -> list[WorkerView]:
        return [w for w in self.state.workers() if w.switching_to is not None]

    def hold(self) -> frozenset[Role]:
        """Pools autoscaling should not grow this round: one a worker is switching to, or that the load
        asks a worker for (switch first, scale when switching cannot help)."""
        roles = {w.switching_to for w in self.switching()}
        if self.signal is not None:
            roles.add(self.signal)
        return frozenset(roles)

    def tick(self, now: float) -> tuple[WorkerView, Role, str] | None:
        """The worker to switch now, the role it takes and why; None to hold. One switch at a time."""
        pr = self.pressure(now)
        want = self.wanted(pr)
        if want != self.signal:
            self.signal, self.signal_since = want, now
        if want is None or self.switching() or now - self.last_switch < self.config.role_switch_dwell_s:
            return None
        if self.signal_since is None or now - self.signal_since < self.config.role_switch_hold_s:
            return None
        lose = Role.DECODE if want is Role.PREFILL else Role.PREFILL
        donors = [w for w in self.state.pools[lose].values() if w.takes_work]
        if len(donors) < 2:
            return None
        w = min(donors, key=lambda v: (self._held(v), v.worker_id))
        reason = (f"prefill {pr.prefill:.2f} of its targets ({pr.prefill_why}); "
                  f"decode {pr.decode:.2f} ({pr.decode_why})")
        return w, want, reason

    def _held(self, w: WorkerView) -> int:
        """What `w` holds of its role now (what the switch has to wait for or move)."""
        if w.role is Role.PREFILL:
            return w.queued_prompt_tokens
        return sum(1 for t in self.state.tracked.values() if t.worker_id == w.worker_id and
                   t.stage in (Stage.ADMITTING, Stage.DECODE))

    # ------------------------------------------------------------------ the switch
    def begin(self, w: WorkerView, to: Role, reason: str, now: float, mixed: bool = False) -> SwitchDecision:
        """`w` starts moving to role `to` (and, joining decode, mixed: `WorkerView.mixed`)."""
        frm = _role_name(w)
        w.switching_to, w.switch_since, w.mixed = to, now, mixed and to is Role.DECODE
        self.last_switch = now
        self.signal, self.signal_since = None, None
        return self._decided(w, frm, "mixed" if w.mixed else to.value, reason, now)

    def set_mixed(self, w: WorkerView, mixed: bool, reason: str, now: float) -> SwitchDecision:
        """A decode worker becomes mixed, or stops being so: at once, nothing to hand on (a mixed worker's
        prompts run whole there, like its sequences)."""
        frm = _role_name(w)
        w.mixed = mixed
        self.last_switch = now
        return self._decided(w, frm, _role_name(w), reason, now, completed=True)

    def _decided(self, w: WorkerView, frm: str, to: str, reason: str, now: float,
                 completed: bool = False) -> SwitchDecision:
        self.state.counters.role_switches += 1
        d = SwitchDecision(now, w.worker_id, frm, to, reason, now if completed else None)
        self.decisions.append(d)
        logger.info("role switch: %s %s -> %s (%s)", w.worker_id, frm, to, reason)
        return d

    def old_role_work(self, w: WorkerView) -> int:
        """Requests of its old role still in flight on switching `w`: prompts it computes (prefill), or
        sequences admitted or decoding there (decode). KV it leased out does not count: it stays
        there, pulled by whichever decode worker admits the request (`Placement.admit`)."""
        if w.role is Role.PREFILL:
            return sum(1 for t in self.state.tracked.values()
                       if t.stage is Stage.PREFILL and t.worker_id == w.worker_id)
        return sum(1 for t in self.state.tracked.values()
                   if t.worker_id == w.worker_id and t.stage in (Stage.ADMITTING, Stage.DECODE))

    def complete(self, w: WorkerView, now: float) -> None:
        """`w` joins the pool of its new role (the worker already took the role: `RoleWorker.set_role`)."""
        to = w.switching_to
        assert to is not None
        self.state.pools[w.role].pop(w.worker_id, None)
        old, w.role, w.switching_to, w.switch_since = w.role, to, None, None
        w.mixed = w.mixed and to is Role.DECODE
        w.queued_prompt_tokens = 0  # (its prompts all ended: `old_role_work`)
        w.reserved_blocks, w.reserved_seqs, w.reserved_prefill_tokens = 0, 0, 0
        if to is Role.PREFILL:
            w.report = None  # a decode worker's picture; joining decode, it keeps what it reported (set_role)
        self.state.pools[to][w.worker_id] = w
        self.last_switch = now  # the dwell counts from when it took the new work
        for i in range(len(self.decisions) - 1, -1, -1):
            if self.decisions[i].worker_id == w.worker_id and self.decisions[i].completed_at is None:
                self.decisions[i] = self.decisions[i]._replace(completed_at=now)
                break
        logger.info("role switch: %s now %s (was %s)", w.worker_id, to.value, old.value)

    def describe(self) -> dict[str, Any]:
        pr = self.last_pressure
        return {"signal": self.signal.value if self.signal is not None else None,
                "pressure": None if pr is None else {"prefill": round(pr.prefill, 3), "decode": round(pr.decode, 3),
                                                     "prefill_why": pr.prefill_why, "decode_why": pr.decode_why},
                "switching": [{"worker_id": w.worker_id, "from": w.role.value, "to": w.switching_to.value,
                               "mixed": w.mixed, "since": w.switch_since} for w in self.switching()],
                "mixed": sorted(w.worker_id for w in self.state.decode.values() if w.mixed),
                "decisions": [d.as_dict() for d in self.decisions]}
