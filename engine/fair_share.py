"""Fair shares between tenants inside one engine's scheduler: which waiting request goes next, and whose
running request is preempted when KV blocks run out.

Queue order: weighted fair queueing (start-time fair queueing's virtual clock, finish tags). A request's
cost is what it may ask of the KV cache, its prompt plus its output allowance (`Request.token_cost`).
When it arrives it gets a finish tag: max(the virtual time, its tenant's last finish tag) + cost/weight;
the virtual time is the start tag of the request admitted last. Waiting requests run by (priority,
finish tag, arrival). A tenant that floods the queue stacks its own tags far ahead; another tenant's
request is tagged from the virtual time, so it goes ahead of the flood's tail at once; a tenant idle for
a while gets no credit for it. Weights share the queue in proportion (weight 2 gets two requests of
equal cost through for each one of a weight-1 tenant while both have requests waiting).

Running requests get each step's tokens lightest tenant first (least running tokens per unit of weight),
and preemption takes the newest request of the heaviest tenant among those not yet given tokens (within
the lowest priority class), so a flood pays for itself and an innocent tenant's request is not picked
while the flooder holds more.

When every sequence slot (`max_num_seqs`) is taken, the next waiting request in fair order takes one
from the heaviest tenant when that evens the shares out (`slot_victim`): a flood that fills the batch
cannot hold another tenant's request in the queue until one of its own ends (the request preempted
for it waits out that step, so it cannot take the slot back first). And while a heavier
tenant's requests are still prefilling, up to half of a step's prompt budget is held back from their
chunks for that next request (`Scheduler._fair_reserve`), so it starts in the step it is admitted; and
while a lighter tenant is active (a request in the engine now or in the last two seconds), heavier
tenants' prompt tokens in a step are capped together (`EngineConfig.tenant_prefill_tokens`: one block
on a CPU, an eighth of the budget on CUDA; `Scheduler._heavy_tenants`), and get none in the step that
starts the lighter tenant's next prompt (`Scheduler._lighter_prompt_starts`): a step's time grows with
its tokens, so the lighter tenant's next prompt waits for a small step, not a full one of the flood's
prompts, and then for a step of its own.

Requests without a tenant (`tenant=None`) are one tenant of weight 1. When no request in the engine
has a tenant, the scheduler keeps its plain (priority, arrival) order and newest-first preemption.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable

from engine.request import Request


def has_tenants(requests: Iterable[Request]) -> bool:
    return any(r.tenant is not None for r in requests)


class FairClock:
    """The virtual clock and each tenant's last finish tag (see the module doc)."""

    def __init__(self):
        self.virtual_time = 0.0
        self._last_finish: dict[str | None, float] = {}

    def tag(self, req: Request) -> None:
        """Give a newly queued request its start and finish tags (a requeued one keeps its own)."""
        if req.fair_finish is not None:
            return
        start = max(self.virtual_time, self._last_finish.get(req.tenant, 0.0))
        req.fair_start = start
        req.fair_finish = self._last_finish[req.tenant] = start + req.token_cost / req.tenant_weight

    def started(self, req: Request) -> None:
        """`req` was admitted: the virtual time moves to its start tag."""
        if req.fair_start is not None:
            self.virtual_time = max(self.virtual_time, req.fair_start)


def fair_order(waiting: list[Request]) -> list[Request]:
    """`waiting` by (priority, finish tag, arrival)."""
    return sorted(waiting, key=lambda r: (r.priority, r.fair_finish or 0.0, r.arrival_time, r.arrival_seq))


def weighted_use(running: Iterable[Request]) -> dict[str | None, float]:
    """Each tenant's running tokens over its weight."""
    use: dict[str | None, float] = defaultdict(float)
    for r in running:
        use[r.tenant] += r.token_cost / r.tenant_weight
    return use


def running_order(running: list[Request]) -> list[Request]:
    """Running requests in the order a step gives them tokens: by priority, then the tenant with the least
    weighted use first, then arrival. Preemption takes victims from the back, the heaviest tenant's."""
    use = weighted_use(running)
    return sorted(running, key=lambda r: (r.priority, use[r.tenant], r.arrival_time, r.arrival_seq))


def slot_victim(head: Request, running: list[Request]) -> Request | None:
    """When every sequence slot is taken and `head` is the next waiting request in fair order: the running
    request to preempt so `head` can start (the heaviest tenant's newest), or None unless `head`'s tenant,
    with `head`, would still hold less than the heaviest tenant holds now (weighted tokens). So a flood
    that fills every slot gives one up to another tenant's request, and two tenants of one request each
    never take a slot from each other in turn (neither holds less than the other with its request)."""
    if head.urgent:
        return None
    use = weighted_use(running)
    pool = [r for r in running if r.priority >= head.priority and r.tenant != head.tenant]
    if not pool:
        return None
    heaviest = max(pool, key=lambda r: use[r.tenant]).tenant
    victim = max((r for r in pool if r.tenant == heaviest), key=lambda r: (r.arrival_time, r.arrival_seq))
    with_head = use[head.tenant] + head.token_cost / head.tenant_weight
    return victim if with_head < use[heaviest] else None


def pick_victim(candidates: list[Request], running: list[Request]) -> Request:
    """Whom to preempt among `candidates` (running requests not yet given this step's tokens): the
    lowest priority class first, then the tenant with the most weighted use, then its newest request."""
    worst = max(r.priority for r in candidates)
    pool = [r for r in candidates if r.priority == worst]
    use = weighted_use(running)
    heaviest = max(pool, key=lambda r: use[r.tenant]).tenant
    return max((r for r in pool if r.tenant == heaviest), key=lambda r: (r.arrival_time, r.arrival_seq))
