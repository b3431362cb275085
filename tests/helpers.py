"""Helpers that more than one test module needs: free ports, an ASGI app served in a thread, polling
with a deadline, a local Ray (with Serve, with pdserve's router), and offline reference runs.

Import it as `helpers` (`from helpers import free_port`): tests/conftest.py puts tests/ on sys.path
(pytest's default `prepend` import mode does that for every conftest's folder). Ray, Serve and uvicorn
load only inside the helpers that start them, so tests without them do not pay for importing them
(and engine tests run on a GPU machine that has none of them).
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, TypeVar

from engine import LLMEngine, RequestOutput, SamplingParams

T = TypeVar("T")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that nothing listens on right now (another process could still take it first)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def tcp_listeners() -> list[tuple[str, int, str]]:
    """(address, port, socket inode) of every TCP socket in LISTEN state in this network namespace (any
    process), from the kernel's tables."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if cols[3] != "0A":  # TCP_LISTEN
                continue
            addr_hex, port_hex = cols[1].split(":")
            raw = bytes.fromhex(addr_hex)
            # the kernel prints each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            out.append((str(ipaddress.ip_address(raw)), int(port_hex, 16), cols[9]))
    return out


def listening_ports() -> set[int]:
    """The ports of every TCP listener in this network namespace (`tcp_listeners`)."""
    return {port for _, port, _ in tcp_listeners()}


def wait_for(get: Callable[[], T], until: Callable[[T], Any] = bool, *, timeout_s: float, interval_s: float = 0.1,
             what: str = "condition") -> T:
    """Call `get` every `interval_s` until `until(value)` holds, and return that value; an
    AssertionError naming `what` and the last value once `timeout_s` has passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = get()
        if until(value):
            return value
        assert time.monotonic() < deadline, f"{what}: not reached in {timeout_s:g}s; last: {value!r}"
        time.sleep(interval_s)


class ThreadedServer:
    """uvicorn serving an ASGI `app` on a free port of 127.0.0.1 in a daemon thread, until `stop()`
    (or the end of a with-block). The socket is bound before the server starts: no race for the port.
    `config`: more `uvicorn.Config` arguments (e.g. `http_limits.uvicorn_limits(cfg)`)."""

    def __init__(self, app: Any, start_timeout_s: float = 10.0, **config: Any):
        import uvicorn

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port: int = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", **config))
        self._thread = threading.Thread(target=self._server.run, kwargs=dict(sockets=[sock]), daemon=True)
        self._thread.start()
        wait_for(lambda: self._server.started, timeout_s=start_timeout_s, interval_s=0.02, what="uvicorn started")

    def stop(self, timeout_s: float = 10.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout_s)

    def __enter__(self) -> ThreadedServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---------------------------------------------------------------------------------------------- Ray
@contextlib.contextmanager
def local_ray(num_cpus: int, env: dict[str, str] | None = None, **init_kwargs: Any) -> Iterator[None]:
    """A fresh local Ray (no dashboard, workers' logs not echoed here) for the with-block. `env` is
    set in this process before `ray.init` (Ray's processes read it when they start); the whole
    environment is restored after `ray.shutdown`."""
    import ray

    saved = dict(os.environ)
    os.environ.update(env or {})
    try:
        ray.init(num_cpus=num_cpus, **{"include_dashboard": False, "log_to_driver": False, **init_kwargs})
        try:
            yield
        finally:
            ray.shutdown()
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def local_serve(num_cpus: int, *, http_port: int | None = None, grpc_port: int | None = None,
                env: dict[str, str] | None = None, **init_kwargs: Any) -> Iterator[int]:
    """`local_ray` with Ray Serve started: HTTP on `http_port` (default: a free port), gRPC on
    `grpc_port` when given. Yields the HTTP port. On exit Serve shuts down, then the router that
    pdserve's app started (with its workers), then Ray."""
    from ray import serve

    from deployments.app import shutdown_router
    from deployments.frontend.grpc_app import grpc_options

    http_port = http_port or free_port()
    options: dict[str, Any] = {"http_options": {"host": "127.0.0.1", "port": http_port}}
    if grpc_port is not None:
        options["grpc_options"] = grpc_options(grpc_port)
    with local_ray(num_cpus, env=env, **init_kwargs):
        try:
            serve.start(**options)
            yield http_port
        finally:
            try:
                serve.shutdown()
            finally:
                shutdown_router()


@contextlib.contextmanager
def pdserve_router(config: Any, timeout_s: float = 600.0) -> Iterator[Any]:
    """pdserve's router (the cluster's named one) for `config`, once its first workers are ready;
    shut down with its workers at the end of the with-block."""
    import ray

    from deployments.app import get_or_create_router, shutdown_router

    try:
        router = get_or_create_router(config)
        ray.get(router.wait_ready.remote(timeout_s), timeout=timeout_s + 100)
        yield router
    finally:
        shutdown_router()


def _holds_nothing(use: dict[str, dict]) -> bool:
    return all(u["num_used_blocks"] == 0 and u["num_requests"] == 0 for u in use.values())


def wait_no_leaks(router: Any, timeout_s: float = 30.0) -> dict[str, dict]:
    """Until no worker of `router` holds a KV block or a request; returns their last reports. Every
    poll also runs each worker engine's integrity check, which raises on a broken block pool."""
    import ray

    return wait_for(lambda: ray.get(router.check_integrity.remote(), timeout=30), _holds_nothing,
                    timeout_s=timeout_s, interval_s=0.2, what="every block freed")


def wait_finished(router: Any, num_requests: int, timeout_s: float = 20.0) -> dict:
    """The router's stats once it counts `num_requests` finished. A worker streams a request's last
    tokens to the hub and reports its end to the router separately, so a client can see its stream
    end a moment before the router counts it."""
    import ray

    return wait_for(lambda: ray.get(router.stats.remote(), timeout=30),
                    lambda stats: stats["counters"]["finished"] >= num_requests,
                    timeout_s=timeout_s, what=f"{num_requests} requests finished")


# ---------------------------------------------------------------------------------------------- references
_offline_ids = itertools.count()


def run_offline(engine: LLMEngine, prompts: Sequence[list[int] | str], params: SamplingParams) -> list[RequestOutput]:
    """The engine alone: every prompt added at once, stepped until none is left; the final outputs,
    in prompt order. The reference that served outputs are compared with (greedy)."""
    ids = [f"offline-{next(_offline_ids)}" for _ in prompts]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[rid] for rid in ids]


@contextlib.contextmanager
def served_cli(args: Sequence[str], ready_timeout_s: float) -> Iterator[tuple[str, subprocess.Popen, list[str]]]:
    """`pdserve serve --port <free> *args` in a child process, as a user starts it: yields (base URL,
    the process, its output lines so far) once it prints that it is ready; then SIGTERM (a graceful
    stop), and a kill if it does not end within 60 s."""
    root = Path(__file__).resolve().parents[1]
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(root), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen([sys.executable, "-m", "deployments.cli", "serve", "--port", str(port), *args],
                            cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + ready_timeout_s
        while not any("pdserve: ready" in line for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            lines.append(proc.stdout.readline())
        yield f"http://127.0.0.1:{port}", proc, lines
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)


def read_until_every_choice(response: Any, num_choices: int) -> set[int]:
    """Read an OpenAI SSE stream (an httpx streaming response) until every one of `num_choices`
    choices has sent a chunk, or the stream ends; returns the choice indices seen."""
    seen: set[int] = set()
    for line in response.iter_lines():
        if line.startswith("data: {"):
            seen.update(c["index"] for c in json.loads(line[6:])["choices"])
        if len(seen) == num_choices:
            break
    return seen



def generate_via_router(router: Any, prompts: Sequence[list[int]], params: SamplingParams,
                        on_progress: Callable[[list[int]], Any] | None = None, tag: str = "r",
                        timeout_s: float = 300.0) -> list[list[int]]:
    """Stream every prompt through pdserve's `router` at once (`RouterBackend`, a StreamHub in this
    process) and return each one's tokens; an error event fails the test. `on_progress(progress)`, a
    coroutine, runs beside the streams with their token counts so far (to act mid-stream)."""
    import asyncio

    from deployments.frontend.router_client import RouterBackend
    from deployments.frontend.stream_hub import StreamHub

    backend = RouterBackend(router, StreamHub(), f"hub-{tag}", request_timeout_s=120)
    progress = [0] * len(prompts)

    async def one(i: int, p: list[int]) -> list[int]:
        toks: list[int] = []
        async for d in backend.generate(f"{tag}{i}-{time.monotonic_ns()}", p, params):
            assert d.finish_reason != "error", d.error
            toks += d.token_ids
            progress[i] = len(toks)
        return toks

    async def run() -> list[list[int]]:
        tasks = [asyncio.create_task(one(i, p)) for i, p in enumerate(prompts)]
        if on_progress is not None:
            await on_progress(progress)
        return await asyncio.wait_for(asyncio.gather(*tasks), timeout_s)

    return asyncio.run(run())


class FakeGrpcContext:
    """What the gRPC door (`GenerationService`) reads of Serve's gRPC context: the call's metadata, and
    the status code and details it sets."""

    def __init__(self, metadata: Sequence[tuple[str, str]] = ()):
        self.metadata = list(metadata)
        self.code = None
        self.details = None

    def invocation_metadata(self):
        return self.metadata

    def set_code(self, code):
        self.code = code

    def set_details(self, details):
        self.details = details
