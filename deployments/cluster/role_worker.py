"""A worker whose role is its state, not its class: prefill or decode, changed by the router without
reloading the model (`--role-switching`, docs/guides/role-switching.md).

It is both roles' actor code on one engine (`PrefillSide` and `DecodeSide`): whatever role it is in,
it finishes what it holds of the other, so a switch never loses a request. The router decides the
role and hands it work accordingly (roles.py, router.py); the worker only needs to know which of its
requests are prompts it computes for another worker (`_prefill_ids`: added by `add`) and which it
decodes (everything else it holds: `admit`, `resume`), and its role's engine settings.

    router: begin switch (no new work of the old role) ─▶ old-role work ends or moves on
            ─▶ set_role(new) ─▶ the new pool's work
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ray

from deployments.cluster.decode_worker import DecodeSide
from deployments.cluster.engine_worker import EngineWorker
from deployments.cluster.messages import Admission, BackupTo, FetchFrom, GenRequest, Role, WorkerSnapshot
from deployments.cluster.prefill_worker import PrefillSide
from deployments.config import ServeConfig
from engine import RequestOutput
from kv_transfer import KVHandle


class RoleSide(PrefillSide, DecodeSide):
    """Both roles on one engine; `role` says which pool the router has it in."""

    def __init__(self, worker_id: str, config: ServeConfig, router: Any, role: Role = Role.DECODE):
        self.role = role  # before the engine is made: its settings are the role's (`engine_config`)
        EngineWorker.__init__(self, worker_id, config, router)
        self._init_exporter()
        self._init_prefill()
        self._init_decode()
        self._prefill_ids: set[str] = set()  # requests `add`ed here: prompts computed for a decode worker
        self.num_switches = 0
        self._start()

    # ------------------------------------------------------------------ the role
    def current_role(self) -> Role:
        return self.role

    def set_role(self, role: Role) -> Role:
        """Take `role` from now on: its engine settings (a decode worker beside a prefill pool caps the
        prompt tokens of a step: `decode_max_prefill_tokens`), its metrics label. What this worker
        holds of the old role carries on (the router moved or waited for it). Returns the old role."""
        role = Role(role)
        with self.lock:
            old, self.role = self.role, role
            if old is not role:
                self.num_switches += 1
                cap = self.config.engine_config(role.value).max_prefill_tokens_per_step
                sched = self.engine.scheduler
                sched.config = dataclasses.replace(sched.config, max_prefill_tokens_per_step=cap)
            report = self.report() if role is Role.DECODE else None
        if report is not None:  # its free blocks (prompts' KV still leased here count), before any admission
            self.router.report_decode.remote(report)
        return old

    def _prefilling(self, request_id: str) -> bool:
        return request_id in self._prefill_ids

    def _took_prompt(self, request_id: str) -> None:
        # NOTE: under the lock, with the request's entry in `requests`: noted before it, the step
        # thread's pruning (`_idle`, `_after_step`) could drop the id in between, and the prompt's
        # output would then be taken for a decoded sequence's (its KV never leased, the router never told).
        self._prefill_ids.add(request_id)

    # ------------------------------------------------------------------ requests of either role
    def admit(self, req: GenRequest, handle: KVHandle, prefill_actor: Any) -> Admission:
        with self.lock:
            self._prefill_ids.discard(req.request_id)
        return DecodeSide.admit(self, req, handle, prefill_actor)

    def resume(self, req: GenRequest, backup: BackupTo | None = None, fetch: FetchFrom | None = None) -> Admission:
        with self.lock:
            self._prefill_ids.discard(req.request_id)
        return DecodeSide.resume(self, req, backup, fetch)

    def abort(self, request_id: str, attempt: int | None = None, in_flight: bool = False) -> bool:
        with self.lock:
            done = DecodeSide.abort(self, request_id, attempt, in_flight)
            if request_id not in self.requests:
                self._prefill_ids.discard(request_id)
            return done

    def num_held(self) -> dict[str, int]:
        """Requests held here, by role (tests, the router's switch)."""
        with self.lock:
            pre = sum(1 for rid in self.requests if rid in self._prefill_ids)
            return {"prefill": pre, "decode": len(self.requests) - pre, "leased": len(self.kv_exporter.leases)}

    def snapshot(self) -> WorkerSnapshot:
        with self.lock:
            snap = self._prefill_snapshot()
            snap.decoding = [r for rid, r in self.requests.items() if rid not in self._prefill_ids]
            return snap

    def kv_stats(self) -> dict:
        return DecodeSide.kv_stats(self)

    def close(self) -> None:
        DecodeSide.close(self)

    # ------------------------------------------------------------------ loop
    def _prune(self) -> None:
        with self.lock:  # in place, under the lock: `_took_prompt` adds under it
            self._prefill_ids.intersection_update(self.requests.keys())

    def _idle(self) -> None:
        PrefillSide._idle(self)
        self._prune()
        DecodeSide._idle(self)

    def _after_step(self, outs: list[RequestOutput], stats) -> None:
        with self.lock:
            pre = [o for o in outs if o.request_id in self._prefill_ids]
            dec = [o for o in outs if o.request_id not in self._prefill_ids]
        if pre:
            PrefillSide._after_step(self, pre, stats)
            self._prune()
        # A prefill-role worker reports its decode side only while it holds sequences of its decode days.
        if dec or self.role is Role.DECODE or len(self.requests) > len(self._prefill_ids):
            DecodeSide._after_step(self, dec, stats)


@ray.remote(max_concurrency=32)
class RoleWorker(RoleSide):
    """A worker of either pool that the router can move to the other (`RoleSide`)."""
