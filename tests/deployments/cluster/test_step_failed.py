"""A failed step on a Ray worker ends only the requests the step held (the single-process layout's rule,
deployments/frontend/backend.py), with a message that carries no exception text. The worker is built
without Ray or a model: only the state `_step_failed` touches."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from deployments.cluster.decode_worker import DecodeWorker
from deployments.cluster.engine_worker import EngineWorker
from conftest import Parts  # tests/deployments/cluster/conftest.py (at import: later the name is another's)
from deployments.cluster.messages import Role


class _Engine:
    def __init__(self, held):
        self.step_request_ids = held
        self.aborted: list[str] = []

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def _worker(cls, held, role=Role.PREFILL):
    w = cls.__new__(cls)
    w.role, w.worker_id, w.lock, w.ranks = role, "w0", threading.RLock(), None  # ranks: not tensor-parallel
    w.engine = _Engine(held)
    w.requests = {rid: SimpleNamespace(request_id=rid, offset=0, hub="h") for rid in ("r1", "r2", "r3")}
    w.pushed, w.finished = [], []
    w._push = lambda events, reqs: w.pushed.extend(events)
    w.router = SimpleNamespace(on_finished=SimpleNamespace(remote=lambda wid, rid: w.finished.append(rid)))
    return w


def test_a_failed_step_ends_only_the_requests_it_held():
    w = _worker(EngineWorker, ["r2"])
    w._step_failed(RuntimeError("secret internal detail at kernel.cu:12"))
    assert w.engine.aborted == ["r2"] and w.finished == ["r2"] and set(w.requests) == {"r1", "r3"}
    (ev,) = w.pushed
    assert ev.request_id == "r2" and ev.finish_reason == "error"
    assert "RuntimeError" in ev.error and "secret" not in ev.error and "kernel.cu" not in ev.error


def test_a_step_that_failed_before_it_scheduled_ends_every_request():
    w = _worker(EngineWorker, None)
    w._step_failed(ValueError("x"))
    assert sorted(w.finished) == ["r1", "r2", "r3"] and not w.requests


def test_a_decode_worker_keeps_the_backups_of_the_requests_that_go_on():
    w = _worker(DecodeWorker.__ray_metadata__.modified_class, ["r1"], Role.DECODE)  # the class under the actor
    w._backups = {"r1": object(), "r3": object()}
    w._step_failed(RuntimeError("boom"))
    assert set(w._backups) == {"r3"} and set(w.requests) == {"r2", "r3"}


# ---------------------------------------------------------------------- refusals reach the door as a 400
def test_a_refusal_naming_a_field_reaches_the_door_as_it_is(parts):
    from deployments.cluster.actions import EndStream
    from deployments.cluster.state import Stage
    from engine import InvalidRequestError
    from engine.errors import parse_invalid_request, refusal_text

    text = refusal_text(InvalidRequestError("response_format", "the grammar did not compile"))
    t = parts.submit("r1", 8)
    t.stage = Stage.ADMITTING
    (end, *_) = parts.recovery.refused(t, "d0", text)
    assert isinstance(end, EndStream)
    refused = parse_invalid_request(end.event.error)
    assert refused is not None and refused.field == "response_format"
    # Anything else still names the worker (and the door shows a generic error: text_stream.py).
    t2 = parts.submit("r2", 8)
    (end2, *_) = parts.recovery.refused(t2, "d0", refusal_text(RuntimeError("internal")))
    assert parse_invalid_request(end2.event.error) is None and "d0" in end2.event.error


def test_the_pending_decode_queue_is_fair_across_tenants():
    from deployments.cluster.placement import fair_pending
    from deployments.cluster.state import Stage

    p = Parts(("p0", "d0"), prefix_aware_routing=False)
    for i in range(6):
        t = p.submit(f"a{i}", 32, arrival=float(i))
        t.req.tenant, t.stage = "flooder", Stage.PENDING_DECODE
        p.state.pending_decode.append(t.req.request_id)
    t = p.submit("b0", 32, arrival=10.0)
    t.req.tenant, t.stage = "innocent", Stage.PENDING_DECODE
    p.state.pending_decode.append("b0")
    assert fair_pending(p.state).index("b0") <= 1  # queued last, it goes first or second
