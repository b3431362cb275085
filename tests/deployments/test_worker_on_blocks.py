"""`EngineHost.on_blocks` (what `EngineWorker._on_blocks` calls): a block-manager call runs under the
engine lock, or during the forward pass of the step holding it, and never while the lock is held for
anything else."""

from __future__ import annotations

import threading
import time
import pytest

from deployments.engine_host import EngineHost


def _worker() -> EngineHost:
    w = object.__new__(EngineHost)  # the locking part only: no engine, no thread
    w.name = "w"
    w.lock, w._window, w._in_forward = threading.RLock(), threading.Lock(), False
    return w


def _hold(w: EngineHost, in_forward: bool, release: threading.Event, held: threading.Event) -> threading.Thread:
    def run():
        with w.lock:
            if in_forward:
                with w.forward():
                    held.set()
                    release.wait(10)
            else:
                held.set()
                release.wait(10)
    th = threading.Thread(target=run)
    th.start()
    held.wait(10)
    return th


def test_runs_at_once_during_the_forward_pass_of_a_step():
    w = _worker()
    release, held = threading.Event(), threading.Event()
    th = _hold(w, True, release, held)
    # NOTE: structural, no time bound: the step holds the lock until `release`, so a call that waited
    # for the lock could only have timed out; it returned while the step is still in its forward pass.
    assert w.on_blocks(lambda: "taken", timeout_s=2.0) == "taken"
    assert th.is_alive() and not release.is_set()  # the step still holds the lock
    release.set()
    th.join()


def test_waits_while_the_lock_is_held_outside_a_forward_pass():
    w = _worker()
    release, held = threading.Event(), threading.Event()
    th = _hold(w, False, release, held)
    with pytest.raises(TimeoutError):
        w.on_blocks(lambda: "taken", timeout_s=0.2)
    threading.Timer(0.2, release.set).start()
    assert w.on_blocks(lambda: "taken", timeout_s=5.0) == "taken"  # once the lock is free
    th.join()


def test_the_step_leaves_its_forward_pass_only_after_a_call_in_it_returns():
    w = _worker()
    release, held, left = threading.Event(), threading.Event(), []

    def step():
        with w.lock:
            with w.forward():
                held.set()
                release.wait(10)
            left.append(time.monotonic())

    th = threading.Thread(target=step)
    th.start()
    held.wait(10)
    done = []

    def slow():
        release.set()  # the step wants to leave its forward pass now
        time.sleep(0.2)
        done.append(time.monotonic())
        return True

    assert w.on_blocks(slow, timeout_s=2.0)
    th.join()
    assert left[0] >= done[0] and not w._in_forward


def test_a_command_whose_caller_stopped_waiting_does_not_end_the_engine_thread():
    """An awaiting task that is cancelled cancels the future of its posted command (asyncio.wrap_future):
    the command still runs, its outcome goes nowhere, and the host keeps serving. (Setting a cancelled
    future's result raised on the engine thread and ended it: every later call of the process hung.)
    Failing idle bookkeeping does not end it either."""
    import types

    from deployments.engine_host import HostHooks

    engine = types.SimpleNamespace(config=types.SimpleNamespace(device="meta", num_threads=None),
                                   has_unfinished_requests=lambda: False)
    idles = []

    def idle():
        idles.append(1)
        if len(idles) == 1:
            raise RuntimeError("idle bookkeeping broke")

    host = EngineHost(engine, "t", HostHooks(after_step=lambda o, s: None, step_failed=lambda e: None, idle=idle),
                      idle_wait_s=0.01)
    ran, gate = [], threading.Event()
    host._commands.append(lambda: gate.wait(10))  # hold the thread so the next command is cancelled first
    host.start()
    try:
        doomed = host.post(lambda eng: ran.append("doomed") or 1)
        failing = host.post(lambda eng: 1 / 0)
        assert doomed.cancel() and failing.cancel()
        gate.set()
        assert host.post(lambda eng: "still here").result(timeout=10) == "still here"
        assert ran == ["doomed"] and host.alive and len(idles) >= 1
        deadline = time.monotonic() + 10
        while len(idles) < 3:  # the idle hook goes on being called after it raised
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        host.stop()
