"""`Router.stats()`: the router's state as JSON-able dicts (the ingress's /health shows it; tests and
benchmarks read counters, pools, decisions and moves from it)."""

from __future__ import annotations

import dataclasses
from typing import Any

from deployments.cluster.messages import Role
from deployments.cluster.pools import Pools
from deployments.cluster.state import RouterState, WorkerView


def _worker(w: WorkerView) -> dict[str, Any]:
    return {"ready": w.ready, "draining": w.draining, "node_id": w.info.node_id if w.info else None}


def router_stats(state: RouterState, pools: Pools, last: int = 20) -> dict[str, Any]:
    """Counters, pools, the `last` scaling decisions and moves, and every worker's view."""
    return {
        "counters": dataclasses.asdict(state.counters),
        "num_tracked": len(state.tracked),
        "num_pending_decode": len(state.pending_decode),
        "num_unplaced": len(state.unplaced),
        "pools": {r.value: pools.describe(r) for r in Role},
        "decisions": [d.as_dict() for d in list(pools.decisions)[-last:]],
        "moves": [m._asdict() for m in list(state.moves)[-last:]],
        "prefill": {w.worker_id: {"queued_prompt_tokens": w.queued_prompt_tokens, **_worker(w),
                                  "created_at": w.created_at, "ready_at": w.ready_at}
                    for w in state.prefill.values()},
        "decode": {w.worker_id: {"max_batch_seen": w.max_batch_seen, "num_steps": w.num_steps,
                                 "free_blocks": w.report.num_free_blocks if w.report else None,
                                 "running": w.report.num_running if w.report else 0,
                                 "prefill_backlog": w.prefill_backlog(), **_worker(w)}
                   for w in state.decode.values()},
    }
