"""The single-process layout: one `LLMEngine` and the OpenAI HTTP app in one process, no Ray.

```
client ──HTTP──▶ uvicorn (this process's event loop) ──▶ http_app ──▶ LocalEngineBackend
                                                                        │ commands
                                      engine thread (owns the LLMEngine, its OpenMP team) ◀──┘
```

Why it exists: on a small CPU host the Ray layouts' own processes (GCS, raylet, dashboard agent, log
monitor, Serve's controller and proxy, the router, the ingress replica, each actor's core worker
waking every 10 ms) run on the same few cores as the engine's OpenMP threads. Every time one of them
preempts an engine thread, the other engine thread waits for it at the end of the parallel region,
so each core-ms they take costs the engine about two. Measured on 2 cores (docs/guides/layouts.md): the Ray colocated layout kept 0.71-0.78x of the engine alone at concurrency 1 and 8; this
layout keeps what the engine alone keeps, less the HTTP work itself. What it gives up is what Ray is
for: more than one worker, a prefill pool, autoscaling, moving sequences off a dead worker and gRPC
through Serve's proxy (its `/metrics` is its own, under the Ray layouts' names); `pdserve serve` refuses those settings here
rather than ignore them (`deployments.layouts.ray_only_settings`).

The same app and backend serve the tests' in-process servers (tests/deployments/test_ingress.py).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING

from deployments.console import print_ready

if TYPE_CHECKING:
    from deployments.config import ServeConfig
    from engine import EngineConfig

# The engine thread and the event loop share this process's GIL: the engine takes it back after every
# torch op, and while the loop holds it (SSE, detokenizing a batch's tokens) it waits up to Python's
# switch interval, 5 ms by default. At 0.5 ms, a 64-request burst on 2 cores served 422.7 and 444.3
# output tok/s against 401.8 and 417.1 (two alternations, one run).
GIL_SWITCH_S = 0.0005
# How long a SIGTERM / Ctrl-C waits for open streams before it cancels them.
GRACEFUL_SHUTDOWN_S = 5.0


def single_process_engine_config(cfg: ServeConfig) -> EngineConfig:
    """The whole engine, as a colocated worker's: with no prefill pool nothing caps a step's prompt
    tokens (`cfg.engine_config("decode")` would, for a decode worker beside a prefill pool: on a
    64-request burst that cap of 128 doubled TTFT p50)."""
    return replace(cfg.engine, max_prefill_tokens_per_step=None)


def build_single_process_app(cfg: ServeConfig):
    """The engine of `cfg` on a thread of its own, behind the OpenAI HTTP
    app; returns (app, backend). `backend.shutdown()` stops the engine."""
    from deployments import metrics, tracing
    from deployments.frontend.backend import LocalEngineBackend
    from deployments.frontend.http_app import build_openai_app
    from deployments.frontend.structured_request import set_schema_limits
    from engine import LLMEngine
    from engine.config import schema_limits

    engine = LLMEngine(single_process_engine_config(cfg))
    backend = LocalEngineBackend(engine, max_queued_requests=cfg.max_queued_requests,
                                 request_timeout_s=cfg.request_timeout_s)
    set_schema_limits(schema_limits(cfg.engine))  # the door refuses what the engines would
    app = build_openai_app(backend, engine.tokenizer, cfg.served_model_name, engine.max_model_len,
                           api_key=cfg.api_key, vocab_size=engine.vocab_size,
                           scheduling_policy=cfg.engine.scheduling_policy, tenants=cfg.tenant_book(),
                           max_request_tokens=cfg.max_request_tokens)
    app.state.pdserve.body_timeout_s = cfg.http_body_timeout_s
    metrics.use_local_registry()
    add_metrics_route(app)
    tracing.configure(cfg.otlp_endpoint, cfg.trace_exporter, "pdserve")
    return app, backend


def add_metrics_route(app) -> None:
    """`GET /metrics`: this process's series in Prometheus' text format, under the Ray layouts' names
    (deployments/metrics.py). Behind the door's API key like /v1/* (http_auth.BearerAuth): a scraper
    sends `Authorization: Bearer KEY` (Prometheus: `authorization: {credentials: KEY}`)."""
    from fastapi.responses import Response

    from deployments import metrics

    async def route() -> Response:
        body, content_type = metrics.render_local()
        return Response(body, media_type=content_type)

    app.add_api_route("/metrics", route, methods=["GET"], response_model=None, include_in_schema=False)


def serve_single_process(cfg: ServeConfig) -> None:
    """Serve `cfg` in this process until SIGINT / SIGTERM (uvicorn handles both), then stop the
    engine. Prints where it serves once it listens."""
    import signal
    import socket
    import sys

    import uvicorn

    from deployments.http_limits import uvicorn_limits

    t0 = time.perf_counter()
    threads = cfg.engine.num_threads or 1
    print(f"pdserve: loading {cfg.served_model_name} in this process ({threads} thread{'s' * (threads > 1)}) ...",
          flush=True)
    app, backend = build_single_process_app(cfg)
    sys.setswitchinterval(GIL_SWITCH_S)
    try:
        # NOTE: bound before the ready line: a client that connects at once waits in the listen
        # backlog until uvicorn's loop accepts, instead of being refused.
        sock = socket.socket(socket.AF_INET6 if ":" in cfg.http_host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((cfg.http_host, cfg.http_port))
        sock.listen(2048)
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning",
                                               timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, **uvicorn_limits(cfg)))
        print_ready(f"http://{cfg.http_host}:{cfg.http_port}", cfg.served_model_name, time.perf_counter() - t0)
        # NOTE: uvicorn turns SIGINT / SIGTERM into a graceful stop, then raises the signal again
        # against the handlers it found: these, so the engine is stopped below rather than the
        # process killed by the default action.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
        server.run(sockets=[sock])
    finally:
        print("pdserve: shutting down", flush=True)
        backend.shutdown()
