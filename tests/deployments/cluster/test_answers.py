"""A request that cannot start fails at once, and an attempt the router gave up on never runs beside
the next one: the answers of `admit` / `resume` classified (`answers.classify`), the router's
bookkeeping for a refusal (`Recovery.refused`), aborts that name their attempt, and the decode
worker's marks for aborts that arrive before their request (`AbortMarks`). Without Ray processes."""

from __future__ import annotations

import asyncio
import time

import ray
from conftest import Parts, kv_handle, request

from deployments.cluster.actions import AbortOn, EndStream, ReleaseKV
from deployments.cluster.answers import Outcome, classify
from deployments.cluster.engine_worker import AbortMarks
from deployments.cluster.messages import Admission
from deployments.cluster.state import Stage


def test_answers_are_classified_by_what_the_request_can_do_next():
    assert classify(Admission(True, report_seq=7)) == (Outcome.ACCEPTED, "", 7)
    # the engine refused it: nowhere else would take it either
    assert classify(Admission(False, "prompt: too long")) == (Outcome.REFUSED, "prompt: too long", 0)
    # a KV pull failed: prefilling it again may work
    assert classify(Admission(False, "KV pull failed", retry=True)).outcome is Outcome.RETRY
    assert classify(asyncio.TimeoutError()).outcome is Outcome.GAVE_UP
    raised = ray.exceptions.RayTaskError("admit", "Traceback ...", TypeError("bug"))
    assert classify(raised).outcome is Outcome.REFUSED  # the method raised: the request, not the worker
    assert "TypeError" in classify(raised).reason
    assert classify(ray.exceptions.RayActorError()).outcome is Outcome.DIED
    assert classify(ray.exceptions.ActorUnavailableError("gone", None)).outcome is Outcome.DIED


def test_a_refused_admission_fails_its_request_at_once_and_frees_both_sides():
    parts = Parts(prefix_aware_routing=False)
    t = parts.submit("a", 40)
    parts.placement.place_prefill(t)
    actions = parts.placement.prefilled("p0", "a", kv_handle("p0", "a", 40, epoch=3))
    assert t.stage is Stage.ADMITTING and len(actions) == 1
    out = parts.recovery.refused(t, "d0", "prompt: 40 tokens do not fit")
    assert "a" not in parts.state.tracked and parts.state.counters.failed == 1
    end = out[0]
    assert isinstance(end, EndStream) and end.event.finished and end.event.finish_reason == "error"
    assert "d0 refused the request" in end.event.error
    assert out[1:] == [AbortOn("d0", "a", 0), ReleaseKV("p0", "a", 3)]
    assert parts.state.num_queued() == 0  # no queue slot held until a timeout


def test_a_refused_run_whole_fails_at_once_without_a_lease_to_release():
    parts = Parts(workers=("d0",), prefix_aware_routing=False)
    t = parts.submit("a", 40)
    parts.placement.place_prefill(t)  # colocated: straight to the decode worker
    assert t.stage is Stage.ADMITTING and t.handle is None
    out = parts.recovery.refused(t, "d0", "cache_salt: too long")
    assert [type(a) for a in out] == [EndStream, AbortOn] and not parts.state.tracked


def test_a_client_abort_names_the_attempt_and_whether_its_call_is_in_flight():
    parts = Parts(prefix_aware_routing=False)
    t = parts.submit("a", 40)
    parts.placement.place_prefill(t)
    t.req.attempt = 2
    assert t.adding  # the prefill worker's `add` is on its way: the abort may run before it
    assert parts.placement.abort("a") == [AbortOn("p0", "a", 2, True)]
    t = parts.submit("c", 40)
    parts.placement.place_prefill(t)
    t.adding = False  # the router saw the `add` answered (`RouterCalls._added`)
    assert parts.placement.abort("c") == [AbortOn("p0", "c", 0, False)]
    t = parts.submit("b", 40)
    parts.placement.place_prefill(t)
    parts.placement.prefilled("p0", "b", kv_handle("p0", "b", 40))
    assert t.stage is Stage.ADMITTING
    assert parts.placement.abort("b") == [AbortOn("d0", "b", 0, True)]  # its admit may still be pulling


def test_abort_marks_are_per_attempt_and_expire():
    marks = AbortMarks(ttl_s=0.05)
    old, new = request("a", 8), request("a", 8)
    old.attempt, new.attempt = 1, 2
    marks.add("a", 1)
    assert not marks.take(new)  # the abort was for the attempt the router gave up on
    assert marks.take(old) and not marks.take(old) and len(marks) == 0
    marks.add("b", None)  # a whole-request abort matches any attempt
    assert marks.take(request("b", 8))
    marks.add("c", 0)
    time.sleep(0.06)
    marks.add("d", 0)  # adding prunes the expired ones
    assert len(marks) == 1
