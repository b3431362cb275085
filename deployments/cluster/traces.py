"""The cluster's share of each traced request's trace (deployments/tracing.py): a worker's open spans by
request id (`WorkerTraces`) and the router's queue and placement spans (`RouterTraces`), all children of
the door's span, whose context the request carries (`GenRequest.trace`).

Only requests that carry a trace get spans, so with tracing off every call returns at its first test.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Iterable, Mapping

from deployments import tracing

# Open spans a worker keeps at most: a request aborted or failed where no hook ends its span is
# dropped (unexported) once this many newer ones are open.
MAX_OPEN_SPANS = 4096


class WorkerTraces:
    """Open spans by request id (prefill: `prefill`; decode: `decode`); thread-safe."""

    def __init__(self, worker_id: str):
        self.worker_id = worker_id
        self._open: dict[str, Any] = {}
        self._lock = threading.Lock()

    def begin(self, name: str, req: Any, attributes: Mapping[str, Any] | None = None) -> None:
        """Open span `name` for `req` (ending one left open by an earlier attempt)."""
        if req.trace is None or not tracing.enabled():
            return
        span = tracing.start(name, req.trace, {"worker": self.worker_id, "attempt": req.attempt, **(attributes or {})})
        with self._lock:
            old = self._open.pop(req.request_id, None)
            self._open[req.request_id] = span
            if len(self._open) > MAX_OPEN_SPANS:
                self._open.pop(next(iter(self._open)))
        tracing.end(old, {"superseded": True})

    def step(self, request_ids: Iterable[str] | None, stats: Any) -> None:
        """After an engine step: a `prefill.chunk` span under each open span whose request it computed."""
        if not self._open or not request_ids:
            return
        end_ns = time.time_ns()
        start_ns = end_ns - int(stats.duration_s * 1e9)
        with self._lock:
            spans = [self._open.get(rid) for rid in request_ids]
        for span in spans:
            if span is not None:
                tracing.record("prefill.chunk", span, start_ns, end_ns,
                               {"step_prefill_tokens": stats.num_prefill_tokens, "step_seqs": stats.num_seqs})

    def child(self, request_id: str, name: str, start_ns: int, attributes: Mapping[str, Any] | None = None,
              end_ns: int | None = None) -> None:
        """A finished span under `request_id`'s open span (from `start_ns` to `end_ns`, default now)."""
        with self._lock:
            span = self._open.get(request_id)
        if span is not None:
            tracing.record(name, span, start_ns, end_ns, attributes=attributes)

    def grammar_waits(self, waits: Iterable[Any]) -> None:
        """The engine's `GrammarWait`s (engine/grammar_waits.py) drained after a step: a `grammar.compile`
        span under each one's open span (prefill or decode); a request without one is not traced here."""
        if not self._open:
            return
        for w in waits:
            self.child(w.request_id, "grammar.compile", tracing.seconds_ns(w.start_time),
                       tracing.grammar_attributes(w), tracing.seconds_ns(w.end_time))

    def end(self, request_id: str, attributes: Mapping[str, Any] | None = None) -> None:
        if not self._open:
            return
        with self._lock:
            span = self._open.pop(request_id, None)
        tracing.end(span, attributes)


# ---------------------------------------------------------------------- the router
class RouterTraces:
    """The router's spans of traced requests: how long each waited for a worker of a pool
    (`router.queue`), and where it went and why (`router.place`)."""

    def __init__(self, local_prefill_max_tokens: int, colocated: bool):
        self.local_prefill_max_tokens = local_prefill_max_tokens
        self.colocated = colocated
        self._waiting_since: dict[str, int] = {}  # request id -> when it joined the decode queue (ns)

    def prefilled(self, req: Any) -> None:
        """`req` joined the queue for a decode worker (its prefill ended)."""
        if req is not None and req.trace is not None and tracing.enabled():
            self._waiting_since[req.request_id] = time.time_ns()

    def forget(self, request_id: str) -> None:
        self._waiting_since.pop(request_id, None)

    def placed(self, kind: str, tracked: Any, worker_id: str, **attributes: Any) -> None:
        """`tracked` goes to `worker_id`: `kind` "prefill" (ToPrefill), "whole" (RunWhole) or "admit" (AdmitKV)."""
        req = tracked.req
        if req.trace is None or not tracing.enabled():
            return
        now = time.time_ns()
        prompt = len(req.prompt_token_ids)
        if kind == "admit":
            pool, since = "decode", self._waiting_since.pop(req.request_id, now)
            reason = "the decode worker with the most free KV blocks and a free slot"
        else:
            pool, since = ("prefill" if kind == "prefill" else "decode"), tracing.seconds_ns(req.arrival_time)
            reason = self._reason(kind, tracked, prompt)
        tracing.record("router.queue", req.trace, min(since, now), now, {"pool": pool, "attempt": req.attempt})
        tracing.record("router.place", req.trace, now, now, {"pool": pool, "worker": worker_id, "reason": reason,
                                                             "attempt": req.attempt, "prompt_tokens": prompt,
                                                             **attributes})

    def _reason(self, kind: str, tracked: Any, prompt: int) -> str:
        if kind == "prefill":
            cached = prompt - tracked.queued_tokens
            return (f"prefix cache hit: {cached} of {prompt} prompt tokens likely cached there" if cached > 0 else
                    "load: the prefill worker that gets through its queue and this prompt first")
        if tracked.req.offset > 0:
            return "moved sequence: resumed where its next token comes soonest"
        if self.colocated:
            return "colocated: the decode worker holding its prefix, unless another is much less loaded"
        return (f"conditional disaggregation: a short prompt (<= {self.local_prefill_max_tokens} tokens) prefilled "
                "on a decode worker that gets to it before the prefill pool")
