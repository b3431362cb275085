"""A decode worker's answer to `admit` / `resume`, as the router acts on it, and the wait for it.

    ACCEPTED ─▶ it decodes there
    REFUSED  ─▶ it cannot start (the engine refused it, or the call raised): its client gets an error
                at once, instead of its request sitting in a queue until the client's own timeout
    RETRY    ─▶ its KV transfer failed: prefill it again (bounded by recovery.MAX_ATTEMPTS)
    DIED     ─▶ the worker died under it: placed again (the death watch sees it too)
    GAVE_UP  ─▶ no answer in time: the worker-side work is cancelled first (`ray.cancel` on the call,
                then `abort(request_id, attempt)` on the worker, awaited), so that attempt can never
                run beside the next one; then placed again

The wait is the only part here that makes Ray calls; `classify` is plain, and tested without Ray.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from typing import Any, NamedTuple

import ray

from deployments.cluster.messages import Admission, GenRequest

logger = logging.getLogger(__name__)

CANCEL_WAIT_S = 10.0  # the longest the router waits for a worker to confirm an abort after giving up


class Outcome(enum.Enum):
    ACCEPTED = "accepted"
    REFUSED = "refused"
    RETRY = "retry"
    DIED = "died"
    GAVE_UP = "gave_up"


class Answer(NamedTuple):
    outcome: Outcome
    reason: str = ""
    report_seq: int = 0  # accepted: `Admission.report_seq`

    @property
    def accepted(self) -> bool:
        return self.outcome is Outcome.ACCEPTED


def classify(result: Admission | BaseException) -> Answer:
    """What an `admit` / `resume` call came back with (its result, or what awaiting it raised)."""
    if isinstance(result, Admission):
        if result.accepted:
            return Answer(Outcome.ACCEPTED, report_seq=result.report_seq)
        return Answer(Outcome.RETRY if result.retry else Outcome.REFUSED, result.reason)
    if isinstance(result, asyncio.TimeoutError):
        return Answer(Outcome.GAVE_UP, "no answer in time")
    if isinstance(result, ray.exceptions.RayTaskError):  # the method itself raised: not the worker's death
        return Answer(Outcome.REFUSED, f"the worker failed to take it ({type(result.cause).__name__})")
    # RayActorError (died, unreachable), a lost object, a cancelled call: the worker, not the request
    return Answer(Outcome.DIED, type(result).__name__)


async def await_answer(ref: Any, actor: Any, req: GenRequest, timeout_s: float) -> Answer:
    """Await `ref` (an `admit` or `resume` of `req` on `actor`) for at most `timeout_s`. On giving up,
    cancel the call and abort that attempt on the worker before returning, so it never decodes beside
    the attempt that replaces it."""
    try:
        result: Admission | BaseException = await asyncio.wait_for(ref, timeout_s)
    except Exception as exc:  # noqa: BLE001 - classified below
        result = exc
    answer = classify(result)
    if answer.outcome is Outcome.GAVE_UP:
        await cancel_on_worker(ref, actor, req)
    if not answer.accepted:
        logger.warning("%s (attempt %d) not started: %s %s", req.request_id, req.attempt, answer.outcome.value,
                       answer.reason)
    return answer


async def cancel_on_worker(ref: Any, actor: Any, req: GenRequest) -> None:
    """Cancel the call `ref` (a queued call never runs; a running one sees `is_canceled()`), and abort
    `req`'s attempt on `actor` (it may have started), waiting for the abort at most CANCEL_WAIT_S."""
    with contextlib.suppress(Exception):
        ray.cancel(ref, recursive=False)  # NOTE: not its KV pull's calls on the exporter: they end on their own
    if actor is None:
        return
    try:
        await asyncio.wait_for(actor.abort.remote(req.request_id, req.attempt, True), CANCEL_WAIT_S)
    except Exception as exc:  # noqa: BLE001 - dead or stuck: the death watch or the pings deal with it
        logger.warning("abort of %s (attempt %d) after giving up failed: %r", req.request_id, req.attempt, exc)
