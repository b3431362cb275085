"""The one place an `LLMEngine` is hosted: its thread, its command queue, its failure handling and its
share of the cores. The single-process server (frontend/backend.py) and the Ray workers
(cluster/engine_worker.py) both run their engine on an `EngineHost`; only what they do with a step's
outputs differs (`HostHooks`).

```
 other threads                         the engine thread (owns the LLMEngine and the OpenMP team)
 post(fn) ──▶ command queue ──wake──▶ apply commands │ before_step │ step() │ after_step(outs, stats)
 with host.lock: ...  (actor calls)         idle (no work): idle() every idle_wait_s, or at once on wake
 on_blocks(fn): under the lock, or during a step's forward pass   a failed step: step_failed(exc)
```

NOTE: only the engine thread steps the engine, and it holds `lock` for every step; other threads
touch the engine either through `post` (applied between steps, never blocking the caller) or under
`lock`. Block-manager calls may also run during a step's forward pass (`on_blocks`), which touches no
request and no block-manager state.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from engine import thread_team
from engine.device_health import is_device_fatal

if TYPE_CHECKING:
    from deployments.cluster.core_share import CoreShare
    from engine import LLMEngine, RequestOutput

logger = logging.getLogger(__name__)
T = TypeVar("T")
# A step whose scheduler held its batch back (static / dynamic batching waits to fill) is followed
# by a nap of this long instead of a spin; a command or `wake` ends it at once.
HELD_BACK_NAP_S = 0.005


def _nothing(*_args: Any) -> None:
    return None


@dataclass(slots=True)
class HostHooks:
    """What the host's owner does at each point of the loop; each runs on the engine thread.

    before_step: under `lock`, right before the step (deferred bookkeeping the step must see).
    after_step: outside `lock`, with the step's outputs and `engine.last_step`.
    step_failed: after a step raised (the host has logged it): fail the requests in flight.
    idle: while there is no work, every `idle_wait_s` (or at a wake-up).
    closing: once, after `stop`, before the thread ends (abort what is left).
    """

    after_step: Callable[[list[RequestOutput], Any], None]
    step_failed: Callable[[BaseException], None]
    before_step: Callable[[], None] = _nothing
    idle: Callable[[], None] = _nothing
    closing: Callable[[], None] = _nothing


def _settle(set_it: Callable[[Any], None], value: Any) -> None:
    """Hand a posted command's outcome to its future, unless the caller cancelled it meanwhile (an
    awaiting task cancelled: `asyncio.wrap_future` cancels the future too). NOTE: set_result on a
    cancelled future raises, and raised on the engine thread it ended the thread: every later request
    of that process then hung."""
    try:
        set_it(value)
    except concurrent.futures.InvalidStateError:
        pass


class EngineHost:
    """Steps one `LLMEngine` on a thread of its own. `start()` once the hooks' owner is ready.

    num_threads: the engine's torch threads; the engine thread alone opens OpenMP teams
    (engine/thread_team.py), and `stop` gives the process its thread count back.
    share: this engine's share of its node's cores (cluster/core_share.py): each step runs on as many
    threads as the share grants. None: always `num_threads`.
    exit_on_device_loss: a step failing with a sticky device error (a broken CUDA context) ends the
    process, so that a supervisor (the Ray router) moves its work, instead of failing every later step.
    """

    def __init__(self, engine: LLMEngine, name: str, hooks: HostHooks, *, share: CoreShare | None = None,
                 idle_wait_s: float = 0.25, exit_on_device_loss: bool = False):
        self.engine = engine
        self.name = name
        self.hooks = hooks
        self.idle_wait_s = idle_wait_s
        self.exit_on_device_loss = exit_on_device_loss
        self.lock = threading.RLock()
        self.num_steps = 0
        self.last_error: str | None = None  # what /health reports: never exception text (that is logged)
        self._step_error = False  # last_error is a failed step's (cleared by the next step that runs)
        self._commands: deque[Callable[[], None]] = deque()
        self._wake = threading.Event()
        self._closed = False
        # The forward pass of a step holds `lock` but touches no block-manager state: `on_blocks`
        # runs a block-manager call meanwhile instead of after the step (seconds on a CPU thread).
        self._window = threading.Lock()
        self._in_forward = False
        self._team = thread_team.confine(engine.config.device, engine.config.num_threads)
        self._share = share if self._team else None
        if share is not None and self._share is None:
            share.close()  # not a CPU engine: nothing to share
        self.max_step_threads = self._team.num_threads if self._team else 0  # the most a step has used
        self._thread = threading.Thread(target=self._run, name=f"{name}-engine", daemon=True)

    # ------------------------------------------------------------------ from other threads
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closed

    def wake(self) -> None:
        """Work was added under `lock`: step now rather than after the idle wait."""
        self._wake.set()

    def post(self, fn: Callable[[LLMEngine], T]) -> concurrent.futures.Future:
        """Run `fn(engine)` on the engine thread between steps, in the order posted; the future holds
        its result. Never blocks the caller (an event loop may call it)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self._closed:
            raise RuntimeError(f"{self.name}: the engine host is stopped")

        def run() -> None:
            try:
                result = fn(self.engine)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                _settle(fut.set_exception, e)
            else:
                _settle(fut.set_result, result)
        self._commands.append(run)
        self._wake.set()
        return fut

    def stop(self, timeout_s: float = 10.0) -> None:
        """Let the thread apply what is posted, run `closing`, and end; then give back its cores."""
        self._closed = True
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)
        if self._team and not self._thread.is_alive():
            self._team.give_back()
            self._team = None

    def on_blocks(self, fn: Callable[[], T], timeout_s: float) -> T:
        """Run `fn`, which may only call the engine's block-manager methods (allocate, free, take or
        cache blocks; nothing about requests), under `lock`, or during the forward pass of the step
        that holds it. TimeoutError after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.lock.acquire(timeout=0.005):
                try:
                    return fn()
                finally:
                    self.lock.release()
            with self._window:
                if self._in_forward:  # the engine thread holds the lock, inside the forward pass
                    return fn()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: engine busy for {timeout_s}s")

    @contextlib.contextmanager
    def forward(self):
        """Entered by the engine thread (holding `lock`) around a step's forward pass."""
        with self._window:
            self._in_forward = True
        try:
            yield
        finally:
            with self._window:
                self._in_forward = False

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        if self._team:
            self._team.own()
        try:
            self._loop()
        finally:
            try:
                self.hooks.closing()
            finally:
                if self._share:
                    self._share.close()

    def _apply_commands(self) -> None:
        while self._commands:
            self._commands.popleft()()

    def _loop(self) -> None:
        eng = self.engine
        threads = self._team.num_threads if self._team else 0
        while True:
            self._wake.clear()
            self._apply_commands()
            if self._closed:
                return
            with self.lock:
                busy = eng.has_unfinished_requests()
            if self._share:
                threads = self._claim_cores(busy, threads)
            if not busy:
                try:
                    self.hooks.idle()
                except Exception:  # noqa: BLE001 - idle bookkeeping must not end the host
                    logger.exception("%s: idle hook failed", self.name)
                if not self._commands:
                    self._wake.wait(self.idle_wait_s)
                continue
            try:
                with self.lock:
                    self.hooks.before_step()
                    outputs = eng.step(forward=self.forward())
                    stats = eng.last_step
                self.num_steps += 1
                if self._step_error:  # a step ran again: the failure is over (health recovers)
                    self._step_error, self.last_error = False, None
                self.hooks.after_step(outputs, stats)
            except Exception as exc:  # noqa: BLE001 - a broken step must not end the host silently
                logger.exception("%s: engine step failed", self.name)
                # NOTE: no exception text: last_error is shown by /health; the text stays in the log.
                self.last_error = f"an engine step failed ({type(exc).__name__}); see the server log"
                self._step_error = True
                self._exit_if_device_broken(exc)
                self.hooks.step_failed(exc)
                continue
            if not outputs and stats.num_seqs == 0 and not self._commands:
                self._wake.wait(HELD_BACK_NAP_S)  # NOTE: the scheduler waits to fill a batch: no spin

    def _claim_cores(self, busy: bool, threads: int) -> int:
        """Set this step's thread count from the node's share (`core_share.py`); returns it."""
        newly_busy = busy and not self._share.busy
        self._share.set_busy(busy)
        if not busy:
            return threads
        n = self._share.threads()
        self._share.claim(n, newly_busy)
        if n != threads:
            self._team.resize(n)
            self.max_step_threads = max(self.max_step_threads, n)
        return n

    def _exit_if_device_broken(self, exc: BaseException) -> None:
        """A sticky device error fails every later step too: exit the process, so the work moves
        elsewhere. `os._exit`: this runs on the engine thread, and the way out must not make more calls
        on the broken device."""
        if self.exit_on_device_loss and is_device_fatal(exc, self.engine.config.device):
            logger.critical("%s: device context broken (%r); exiting so the work moves elsewhere", self.name, exc)
            os._exit(1)
