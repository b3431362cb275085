"""`Router.stats()`: the router's state as JSON-able dicts (the ingress's /health shows it; tests and
benchmarks read counters, pools, decisions and moves from it)."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

from deployments.cluster.messages import Role
from deployments.cluster.pools import Pools
from deployments.cluster.roles import RoleController
from deployments.cluster.state import RouterState, WorkerView
from engine.spec.speculator import SpecStats


def _worker(w: WorkerView) -> dict[str, Any]:
    i = w.info
    return {"ready": w.ready, "draining": w.draining,
            "switching_to": w.switching_to.value if w.switching_to is not None else None, "mixed": w.mixed,
            "node_id": i.node_id if i else None,
            "node_ip": i.node_ip if i else None, "device": i.device if i else None,
            "num_threads": i.num_threads if i else None, "num_blocks": i.num_blocks if i else None}


def spec_summary(spec: SpecStats | None) -> dict[str, Any] | None:
    """A decode worker's speculative-decoding counters as /health shows them (None: speculation off)."""
    if spec is None:
        return None
    return {"method": spec.method, "num_drafted": spec.num_drafted, "num_accepted": spec.num_accepted,
            "num_emitted": spec.num_emitted, "num_verified_rows": spec.num_verified_rows,
            "acceptance_rate": round(spec.acceptance_rate, 4),
            "mean_accepted_length": round(spec.mean_accepted_length, 4)}


def router_stats(state: RouterState, pools: Pools, roles: RoleController | None = None,
                 last: int = 20) -> dict[str, Any]:
    """Counters, pools, the `last` scaling decisions and moves, every worker's view, and the role
    controller's state (`roles`, with role switching on)."""
    return {
        "roles": roles.describe() if roles is not None else None,
        "counters": dataclasses.asdict(state.counters),
        "num_tracked": len(state.tracked),
        "tracked_by_stage": dict(collections.Counter(t.stage.value for t in state.tracked.values())),
        "num_pending_decode": len(state.pending_decode),
        "num_unplaced": len(state.unplaced),
        "pools": {r.value: pools.describe(r) for r in Role},
        # requests waiting for a worker of each pool (the `pdserve_queue_depth` gauge's values)
        "queues": {Role.PREFILL.value: state.num_waiting_prefill(), Role.DECODE.value: len(state.pending_decode)},
        "max_num_seqs": pools.config.engine.max_num_seqs,
        "decisions": [d.as_dict() for d in list(pools.decisions)[-last:]],
        "moves": [m._asdict() for m in list(state.moves)[-last:]],
        "prefill": {w.worker_id: {"queued_prompt_tokens": w.queued_prompt_tokens, **_worker(w),
                                  "created_at": w.created_at, "ready_at": w.ready_at}
                    for w in state.prefill.values()},
        "decode": {w.worker_id: {"max_batch_seen": w.max_batch_seen, "num_steps": w.num_steps,
                                 "free_blocks": w.report.num_free_blocks if w.report else None,
                                 "running": w.report.num_running if w.report else 0,
                                 "waiting": w.report.num_waiting if w.report else 0,
                                 "prefill_backlog": w.prefill_backlog(), **_worker(w),
                                 "speculation": spec_summary(w.report.spec if w.report else None)}
                   for w in state.decode.values()},
        # every (prefill worker, decode worker) KV pair as its decode worker last reported it
        # (kv_transfer/pair_stats.py): transport, probe / live GB/s, transfers, bytes, failures by cause
        "kv_pairs": [p for w in state.workers() for p in w.kv_pairs.values()],
    }
