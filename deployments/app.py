"""The Serve application: an OpenAI-compatible ingress in front of the router and its worker pools.

`build_app(args)` is the thin public builder (also the `import_path` for `serve run` / `serve deploy`):
it checks the whole config up front and says what to fix (`ServeConfigError`). Its args take exactly
the names of `pdserve serve`'s flags, with underscores (`ServeConfig.from_dict`), or a `ServeConfig`
already parsed (`pdserve serve`). The config is parsed once and passed on as is: to the ingress
replicas, the router and from it the workers.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

import ray
from ray import serve

from deployments import tracing
from deployments.config import ServeConfig
from engine.config import schema_limits
from deployments.frontend.http_app import build_openai_app
from deployments.frontend.structured_request import set_schema_limits
from deployments.frontend.router_client import RouterBackend
from deployments.frontend.stream_hub import StreamHub

logger = logging.getLogger(__name__)

ROUTER_NAME = "pdserve-router"
NAMESPACE = "pdserve"


def get_or_create_router(config: ServeConfig) -> Any:
    """The one router of this cluster (a detached named actor; it owns the worker pools), on a node
    with `config.router_resources` when they are set."""
    # Imported here: the router's module brings the workers' (torch), which the door's process never runs.
    from deployments.cluster.router import RouterActor

    return RouterActor.options(name=ROUTER_NAME, namespace=NAMESPACE, get_if_exists=True, lifetime="detached",
                               resources=dict(config.router_resources) or None).remote(config)


def shutdown_router(timeout_s: float = 30.0) -> None:
    """Kill the router and its workers (they are owned by it)."""
    from deployments.cluster.pools import WORKER_PREFIX

    try:
        router = ray.get_actor(ROUTER_NAME, namespace=NAMESPACE)
    except ValueError:
        return
    try:
        ray.get(router.shutdown.remote(), timeout=timeout_s)
    except Exception:  # noqa: BLE001 - it may be dead already
        pass
    ray.kill(router)
    # The names go once the GCS has buried the actors; a router created before that would find the
    # old one (get_if_exists) or adopt the dead workers.
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        names = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a.get("namespace") == NAMESPACE}
        if not any(n == ROUTER_NAME or n.startswith(WORKER_PREFIX) for n in names):
            return
        time.sleep(0.1)


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1024)
@serve.ingress()
class OpenAIIngress:
    def __init__(self, cfg: ServeConfig):
        from engine.model_loader import load_tokenizer

        serve_http_limits(cfg)  # first: a setting this replica's HTTP server cannot honour stops it here
        tracing.configure(cfg.otlp_endpoint, cfg.trace_exporter, "pdserve-ingress")
        self.router = get_or_create_router(cfg)
        info = ray.get(self.router.wait_ready.remote(900.0), timeout=960.0)
        hub_id = f"hub-{uuid.uuid4().hex[:8]}"
        self.hub = StreamHub()  # in this replica's process: it lives and dies with it
        # NOTE: resolved on this replica's own node from the model spec: info.model_dir is a path on a
        # worker's node, which a multi-node cluster's ingress node need not have.
        tokenizer = load_tokenizer(cfg.engine.model, cfg.engine.dtype, cfg.engine.cache_dir)
        self.backend = RouterBackend(self.router, self.hub, hub_id, cfg.request_timeout_s)
        set_schema_limits(schema_limits(cfg.engine))  # the door refuses what the engines would
        self._asgi = build_openai_app(self.backend, tokenizer, cfg.served_model_name, info.max_model_len,
                                      api_key=cfg.api_key, vocab_size=info.vocab_size,
                                      scheduling_policy=cfg.engine.scheduling_policy, tenants=cfg.tenant_book(),
                                      max_request_tokens=cfg.max_request_tokens)
        self._asgi.state.pdserve.body_timeout_s = cfg.http_body_timeout_s

    def __serve_build_asgi_app__(self):
        # NOTE: built per replica after __init__, so the app holds this replica's backend and hub.
        return self._asgi


def direct_ingress_on() -> bool:
    """Whether Serve's direct ingress serves HTTP in this process's replicas (Ray reads its variables
    when the process starts)."""
    from ray.serve._private import constants

    return bool(getattr(constants, "RAY_SERVE_ENABLE_DIRECT_INGRESS", False))


def serve_http_limits(cfg: ServeConfig) -> None:
    """Give this ingress replica's HTTP server `cfg`'s limits (direct ingress), or refuse the limits
    Serve's proxy cannot honour (ServeConfigError naming them): deployments/http_limits.py. With direct
    ingress the replica also opens no gRPC server of its own (`no_replica_grpc_server`)."""
    from deployments.config import ServeConfigError
    from deployments.http_limits import apply_to_direct_ingress, proxy_limits_error

    if direct_ingress_on():
        apply_to_direct_ingress(cfg)
        no_replica_grpc_server()
    elif why := proxy_limits_error(cfg):
        raise ServeConfigError(why)


def no_replica_grpc_server() -> None:
    """With direct ingress and gRPC options, Serve 2.60 starts a gRPC server in every ingress replica
    (`Replica._maybe_start_direct_ingress_servers`: every interface, ports from
    RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT), beside the gRPC proxy on `--grpc-port` that pdserve's clients
    are told to use and that routes to the replica over Ray all the same. Such a listener on the HTTP
    app's replica served no method yet answered reflection. So in this process (one replica) the
    replica module's `is_grpc_enabled` answers False: the replica opens none. A Ray laid out otherwise
    is told in the log, naming the listener it may open."""
    try:
        from ray.serve._private import replica
    except ImportError:  # pragma: no cover - a Ray without it
        replica = None
    if not callable(getattr(replica, "is_grpc_enabled", None)):
        logger.warning("this Ray's direct ingress may open a gRPC server on every ingress replica (ports from "
                       "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT, every interface) that pdserve cannot turn off: "
                       "firewall those ports, or serve gRPC with --no-direct-ingress")
        return
    replica.is_grpc_enabled = _no_grpc


def _no_grpc(*_args: Any, **_kwargs: Any) -> bool:
    return False


def _router_serving_state(cfg: ServeConfig):
    """gRPC ingress factory: the same router backend as HTTP, with this replica's own StreamHub."""
    from engine.model_loader import load_tokenizer

    from deployments.frontend.grpc_app import ServingState

    serve_http_limits(cfg)  # this replica's own HTTP server (direct ingress) gets the limits too
    router = get_or_create_router(cfg)
    info = ray.get(router.wait_ready.remote(900.0), timeout=960.0)
    hub = StreamHub()
    backend = RouterBackend(router, hub, f"hub-{uuid.uuid4().hex[:8]}", cfg.request_timeout_s)
    return ServingState(backend, load_tokenizer(cfg.engine.model, cfg.engine.dtype, cfg.engine.cache_dir),
                        cfg.served_model_name,
                        info.max_model_len, info.vocab_size, cfg.engine.scheduling_policy)


def _config(args: dict | ServeConfig | None) -> ServeConfig:
    return args if isinstance(args, ServeConfig) else ServeConfig.from_dict(args or {})


def build_grpc_app(args: dict | ServeConfig | None = None) -> serve.Application:
    """The gRPC twin of `build_app` (serve it with `route_prefix="/pdserve-grpc"` and gRPC options)."""
    import functools

    from deployments.frontend.grpc_app import GRPCIngress

    cfg = _config(args)
    return GRPCIngress.options(ray_actor_options=cfg.ingress_actor_options(), **cfg.ingress_options()).bind(
        functools.partial(_router_serving_state, cfg), api_key=cfg.api_key, tenants_file=cfg.api_keys_file,
        max_request_tokens=cfg.max_request_tokens)


def build_app(args: dict | ServeConfig | None = None) -> serve.Application:
    """Build the pdserve application from a settings dict: `pdserve serve`'s flag names with
    underscores (docs/reference/settings.md). Raises ServeConfigError on an unknown or bad setting."""
    cfg = _config(args)
    return OpenAIIngress.options(ray_actor_options=cfg.ingress_actor_options(), **cfg.ingress_options()).bind(cfg)
