"""Serving settings: one frozen dataclass, checked when built, shared by the CLI, the app builder and
the actors. Each field documents itself (`setting(...)`); `pdserve serve`'s flags, the keys of
`serve_config.yaml` / `build_app(args)` and docs/reference/settings.md's tables are made from these fields
(`deployments.config_fields`)."""

from __future__ import annotations

import difflib
import functools
import os
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from deployments.config_fields import Setting, settings_of
from deployments.tracing import check_exporter
from engine import EngineConfig
from engine.config import setting
from engine.errors import EngineConfigError


class ServeConfigError(EngineConfigError):
    """A server setting is invalid; the message names it and says what to fix. A subclass of
    `EngineConfigError` so one `except` catches every bad setting on the server path (the engine's
    own checks run inside `ServeConfig`)."""


# Second names of settings, valid as flags (`--prefill-workers`) and as YAML keys (`prefill_workers`).
ALIASES: dict[str, str] = {"prefill_workers": "num_prefill_workers", "decode_workers": "num_decode_workers",
                           "threads_per_worker": "num_threads", "prefix_caching": "enable_prefix_caching",
                           "host": "http_host", "port": "http_port"}
# Engine settings the server sets per role itself: {engine field: the server setting to use instead}.
SERVER_SET: dict[str, str] = {"max_prefill_tokens_per_step": "decode_max_prefill_tokens",
                              "tensor_parallel_size": "prefill_tp and decode_tp"}
# Every worker's engine unless told otherwise: one torch thread, so two workers on two cores do not fight.
DEFAULT_ENGINE = EngineConfig(num_threads=1)

# Ray settings for a Ray instance pdserve starts itself (an existing cluster keeps its own). Serve's
# controller loop runs every 0.1 s by default; here it only watches the ingress replicas (the router
# scales the worker pools), and on a small CPU node every 0.1 s cost 2.5% of a core, time taken from
# the engine's threads.
# NOTE: Ray starts its worker processes (every actor: the engine workers too) at nice 15, below its
# own daemons (GCS, raylet, dashboard agent, log monitor), the driver and any client on the node,
# which all run at nice 0: on a CPU node the engine's threads then yield to all of them. At nice 0
# the engine shares the cores on equal terms, as any other server process does. (The served step's
# gap to the engine alone, 54 against 35 ms at batch 1 then, was mostly OpenMP: engine/thread_team.py.)
RAY_ENV_DEFAULTS = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "1.0", "RAY_worker_niceness": "0"}


def apply_ray_env_defaults() -> None:
    """Set `RAY_ENV_DEFAULTS` in this process's environment (not overriding the user's) before
    `ray.init` starts a local Ray, whose processes inherit it."""
    for k, v in RAY_ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)


def direct_ingress_env(http_port: int, num_ports: int, drain_s: float) -> dict[str, str]:
    """Environment for Ray Serve's direct ingress: every HTTP ingress replica serves HTTP itself, on
    a port of [http_port, http_port + num_ports) (the first replica to start gets `http_port`),
    instead of behind Serve's proxy; a stopping replica with nothing in flight keeps its port `drain_s`
    seconds (`ingress_drain_s`). Ray reads it when Serve's controller and replicas start, so it
    must be in the environment of the processes Ray starts (`pdserve serve` sets it before it starts
    Ray; on an existing cluster set it on every node).

    NOTE: the proxy relays every streamed chunk between two processes. On 2 CPU cores that cost
    ~1.5 ms of CPU per output token, 14-15% of the engine's throughput; with direct ingress the
    serving layer costs a few percent (benchmarks/serving_overhead.py)."""
    return {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
            "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(http_port),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(http_port + num_ports),
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": str(drain_s)}


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """The whole server: pools, routing, KV transfer, queue, ingress, autoscaling, and every worker's
    engine settings (`engine`; flat in flags and YAML)."""

    # Not a setting of its own: its fields are (flattened). A decode worker next to a prefill pool
    # also gets `decode_max_prefill_tokens` (`engine_config`).
    engine: EngineConfig = field(default_factory=lambda: DEFAULT_ENGINE)
    model_name: str | None = setting(None, "the name clients pass as `model`", default_doc="from the model")
    num_prefill_workers: int = setting(1, "prefill pool size at start (Ray actors, each with its own engine); "
                                          "0: colocated, each decode worker prefills its own prompts",
                                       doc="See Colocated mode")
    num_decode_workers: int = setting(1, "decode pool size at start")
    worker_num_cpus: float = setting(1.0, "Ray CPUs per worker actor")
    worker_num_gpus: float = setting(0.0, "Ray GPUs per worker actor (1 on GPU nodes)")
    prefill_tp: int = setting(
        1, "tensor-parallel ranks per prefill worker: its model split over that many Ray actors on one node",
        doc="See Tensor parallelism. A worker of N ranks is one placement group of N bundles (STRICT_PACK: one "
            "node), each bundle `worker_num_cpus` CPUs and `worker_num_gpus` GPUs; rank 0 is the worker the "
            "router sees, the other ranks are actors it starts. Must divide the model's attention heads, "
            "intermediate size and KV heads (or be a multiple of the KV heads)")
    decode_tp: int = setting(
        1, "tensor-parallel ranks per decode worker (colocated: every worker); may differ from prefill_tp",
        doc="See Tensor parallelism. KV moves between pools of different degrees with every KV head "
            "(rank 0 of each side gathers from or scatters to its ranks)")
    prefill_resources: dict[str, float] = setting(
        help_text="custom Ray resources per prefill worker, as JSON", default_factory=dict,
        doc='`--cluster-resources` sets {"prefill": 0.01}, which pins the pool to the `prefill` node type '
            "of cluster.yaml")
    decode_resources: dict[str, float] = setting(help_text="custom Ray resources per decode worker, as JSON",
                                                 default_factory=dict)
    router_resources: dict[str, float] = setting(
        help_text="custom Ray resources for the router actor, as JSON", default_factory=dict,
        doc='{"head": 0.01} keeps it on the head node type of cluster.yaml, off the GPU nodes the autoscaler '
            "adds and removes (created by the first ingress replica; a running router keeps its place)")
    ingress_resources: dict[str, float] = setting(
        help_text="custom Ray resources per HTTP / gRPC ingress replica, as JSON", default_factory=dict,
        doc="Each replica holds its stream hub in its own process")
    # NOTE: 128, not 256: on a CPU thread a 256-token chunk takes ~0.7 s, a gap every client of that
    # worker sees, and the gap a dead worker's clients had already waited before their sequences move.
    # Measured (fault_figures, 1P+2D on 2 cores): the longest stall after a kill met its target in 4 of
    # 8 kills at 128 against 1 of 6 at 256, with the same throughput (serving_overhead, 3 passes).
    decode_max_prefill_tokens: int | None = setting(
        128, "with a prefill pool: prompt tokens a decode worker computes per step (local prefills), so its "
             "running sequences keep streaming between chunks; none: max_num_batched_tokens",
        doc="An urgent recompute of a moved sequence is not held to it")
    local_prefill_max_tokens: int = setting(
        512, "conditional disaggregation: a prompt up to this long is prefilled on a decode worker when that "
             "would start it sooner than the prefill pool's queue (0: always the prefill pool)",
        doc="See Conditional disaggregation")
    share_node_cores: bool = setting(
        True, "CPU workers of one node also step on the cores of the node's idle workers: each uses "
              "max(num_threads, node cores // workers with work) threads, counted again every step",
        doc="See Choosing a layout")
    prefix_aware_routing: bool = setting(
        True, "send each prompt where its prefix is likely cached, weighed against the queues "
              "(needs enable_prefix_caching)", doc="See Prefix caching and cache-aware routing")
    kv_backup: bool = setting(
        True, "copy a prompt a decode worker prefilled itself (local prefill, moved sequence) into a prefill "
              "worker's prefix cache, so if that decode worker dies its sequence is recomputed from the end of "
              "its prompt (needs prefix-aware routing)", doc="See Scaling and failures")
    kv_prefix_fetch: bool = setting(
        True, "a dead decode worker's sequence moved to another decode worker first pulls the part of its "
              "prompt a prefill worker caches, instead of recomputing the whole prompt there",
        doc="See Scaling and failures")
    max_queued_requests: int = setting(
        256, "requests admitted but not yet decoding; beyond it new requests get 429 + Retry-After")
    kv_lease_s: float = setting(60.0, "how long a prefill worker keeps a request's KV for a decode worker to pull")
    kv_transfer_timeout_s: float = setting(30.0, "the longest one KV transfer may take before it is retried")
    request_timeout_s: float = setting(300.0, "a request that produces nothing for this long ends with an error")
    client_check_s: float = setting(
        5.0, "how often a worker asks the ingress replicas which of its requests still have a client; one "
             "whose client is gone is aborted there (the backstop for an abort that never arrived)")
    prefill_min_workers: int | None = setting(None, "prefill pool lower bound", group="scaling",
                                              default_doc="num_prefill_workers")
    prefill_max_workers: int | None = setting(None, "prefill pool upper bound (above the start size: autoscaling)",
                                              group="scaling", default_doc="num_prefill_workers")
    decode_min_workers: int | None = setting(None, "decode pool lower bound", group="scaling",
                                             default_doc="num_decode_workers")
    decode_max_workers: int | None = setting(None, "decode pool upper bound (above the start size: autoscaling)",
                                             group="scaling", default_doc="num_decode_workers")
    prefill_target_queued_tokens: int = setting(
        2048, "queued prompt tokens to compute per prefill worker (the parts the router expects in the prefix "
              "cache not counted); more: scale up, less: down", group="scaling")
    decode_target_waiting: int = setting(
        4, "prefilled sequences waiting for a decode slot, per decode worker, before scaling up", group="scaling")
    decode_target_kv_use: float = setting(
        0.85, "mean KV-block use of the decode pool before scaling up (down below half of it)", group="scaling")
    upscale_delay_s: float = setting(2.0, "how long a scale-up signal must hold before acting", group="scaling")
    downscale_delay_s: float = setting(15.0, "how long a scale-down signal must hold before acting",
                                       group="scaling")
    autoscale_interval_s: float = setting(0.5, "how often the router re-evaluates the pool sizes", group="scaling")
    role_switching: bool = setting(
        False, "workers change role (prefill <-> decode) as the load shifts, without reloading the model",
        doc="A controller in the router moves one worker at a time from the pool with room to spare to the pool "
            "over its targets (queued prompt tokens, decode slots and KV use, and ttft_target_ms / tpot_target_ms "
            "where set); queue-depth autoscaling then adds workers only where switching cannot meet them. Needs a "
            "prefill pool and prefill_tp = decode_tp. See docs/guides/role-switching.md",
        group="roles")
    ttft_target_ms: float | None = setting(
        None, "the time to first token the prefill side is held to (none: queue depth only)",
        doc="Measured by the router from a request's arrival to its prefilled KV (p90 of the last "
            "role_switch_window_s). Over it, the role controller moves a worker to prefill, or else the "
            "autoscaler adds one (within prefill_max_workers)", group="roles")
    tpot_target_ms: float | None = setting(
        None, "the time per output token the decode side is held to (none: slots and KV only)",
        doc="Measured as the decode workers' step times (p90 of the last role_switch_window_s). Over it, the "
            "role controller moves a worker to decode, or else the autoscaler adds one (within "
            "decode_max_workers)", group="roles")
    role_switch_hold_s: float = setting(
        3.0, "how long a shift must hold before a worker switches role (hysteresis)", group="roles")
    role_switch_dwell_s: float = setting(
        15.0, "the least time between two role switches: a switched worker keeps its role at least this long",
        group="roles")
    role_switch_drain_s: float = setting(
        5.0, "how long a worker leaving the decode role lets its sequences finish before the rest move on",
        doc="Moved sequences resume on the other decode workers from the tokens their clients have, as after a "
            "worker's death (greedy output unchanged)", group="roles")
    role_switch_window_s: float = setting(
        10.0, "the window of measured TTFT / step times the targets are judged on", group="roles")
    health_check_timeout_s: float = setting(10.0, "a worker that does not answer a ping this long is treated as dead",
                                            group="scaling")
    api_key: str | None = setting(None, "require `Authorization: Bearer KEY` on /v1/*",
                                  default_doc="$PDSERVE_API_KEY on the command line, else none")
    api_keys_file: str | None = setting(
        None, "a JSON file of API keys, each a tenant with a name, weight, limits, rate and prefix-cache scope",
        doc="See docs/guides/tenants.md; with api_key too, that key stays valid "
            "(no tenant). Read by every ingress replica: on a multi-node cluster the path must exist on their nodes")
    max_request_tokens: int | None = setting(
        262144, "the most tokens one call may ask for: prompts x n x (prompt + max_tokens); more is a 400 "
                "(none: no cap)", doc="Bounds what one fan-out call can claim of the queue and the KV pool")
    http_limit_concurrency: int | None = setting(
        1024, "open HTTP connections (and requests) at most per HTTP server; more are answered 503 (none: no cap)",
        doc="uvicorn's limit_concurrency: the single-process layout's server and, with direct ingress, the ingress "
            "replica's (beside max_ongoing_requests, 1024 per replica). Serve's proxy takes no such cap: a value other "
            "than the default is refused there (docs/guides/tenants.md#http-limits)")
    http_keepalive_timeout_s: float = setting(
        5.0, "an idle keep-alive HTTP connection is closed after this long",
        doc="The single-process layout's server and, with direct ingress, the ingress replica's; Serve's proxy "
            "(http_options keep_alive_timeout_s, whole seconds: rounded up) where `pdserve serve` starts Serve")
    http_header_timeout_s: float = setting(
        10.0, "a connection must send a whole request head (line and headers) within this long of connecting "
              "or of its previous response, else it is closed",
        doc="The single-process layout's server and, with direct ingress, the ingress replica's "
            "(deployments/http_limits.py). Serve's proxy has no head deadline: a value other than the default is "
            "refused there")
    http_body_timeout_s: float = setting(
        30.0, "a request body must arrive whole within this long of its headers, else 408", doc="Every layout")
    http_host: str = setting("127.0.0.1", "HTTP bind address (0.0.0.0 to expose it)",
                             doc="Under `serve run` / `serve deploy`, Serve's `http_options` decide instead")
    http_port: int = setting(8000, "HTTP port",
                             doc="Under `serve run` / `serve deploy`, Serve's `http_options` decide instead")
    ingress_replicas: int = setting(1, "HTTP and gRPC ingress replicas at start")
    ingress_max_replicas: int | None = setting(
        None, "above ingress_replicas: Serve autoscales the HTTP/gRPC ingress on ongoing requests up to this "
              "many replicas", default_doc="ingress_replicas")
    ingress_target_ongoing_requests: float = setting(64.0, "ongoing requests per ingress replica Serve aims for")
    direct_ingress: bool = setting(
        False, "the ingress replica serves HTTP on http_port itself (Ray Serve's direct ingress), without the "
               "proxy's relay of every streamed token; Serve's proxy moves to a free port (printed)",
        doc="See Direct ingress below; under `serve run` / `serve deploy` set Ray's variables yourself")
    ingress_drain_s: float = setting(
        2.0, "with direct_ingress: how long a stopping ingress replica with no request in flight keeps its port "
             "open, for a load balancer in front of it to notice (requests in flight always finish first)",
        doc="Ray's RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S, whose own default (30 s) made every stop "
            "take over half a minute")
    otlp_endpoint: str | None = setting(
        None, "send a trace of every request (OpenTelemetry) to this OTLP/HTTP endpoint, e.g. "
              "http://collector:4318/v1/traces; off when unset (no cost)",
        doc="Needs the OTLP exporter: `pip install 'pdserve[otel]'`. See docs/guides/observability.md")
    trace_exporter: str | None = setting(
        None, "development: also write every request's trace to the console (`console`) or as JSON lines to "
              "`file:PATH` (one file per process, `PATH.<pid>`)", doc="See docs/guides/observability.md")

    def direct_ingress_ports(self) -> int:
        """HTTP ports direct ingress may hand out: one per ingress replica of the HTTP and of the gRPC
        app (Serve gives every ingress replica one, the first goes to `http_port`)."""
        return 2 * (self.ingress_max_replicas or self.ingress_replicas)

    def __post_init__(self) -> None:
        if not isinstance(self.engine, EngineConfig):
            raise ServeConfigError(f"engine must be an EngineConfig, got {type(self.engine).__name__}")
        if self.engine.num_threads is not None and self.engine.num_threads < 1:
            raise ServeConfigError(f"num_threads must be >= 1, got {self.engine.num_threads}")
        for name in ("num_decode_workers", "max_queued_requests"):
            if getattr(self, name) < 1:
                raise ServeConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_prefill_workers < 0:
            raise ServeConfigError(f"num_prefill_workers must be >= 0 (0: colocated), got {self.num_prefill_workers}")
        for name in ("worker_num_cpus", "worker_num_gpus", "local_prefill_max_tokens", "upscale_delay_s",
                     "downscale_delay_s", "ingress_drain_s", "role_switch_hold_s", "role_switch_dwell_s",
                     "role_switch_drain_s"):
            if getattr(self, name) < 0:
                raise ServeConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("kv_lease_s", "kv_transfer_timeout_s", "request_timeout_s", "ingress_target_ongoing_requests",
                     "autoscale_interval_s", "client_check_s", "http_keepalive_timeout_s", "http_header_timeout_s",
                     "http_body_timeout_s", "role_switch_window_s"):
            if getattr(self, name) <= 0:
                raise ServeConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.decode_max_prefill_tokens is not None and self.decode_max_prefill_tokens <= 0:
            raise ServeConfigError(f"decode_max_prefill_tokens must be > 0 (or none: max_num_batched_tokens), "
                                   f"got {self.decode_max_prefill_tokens}")
        try:
            check_exporter(self.trace_exporter)
        except ValueError as e:
            raise ServeConfigError(str(e)) from None
        for name in ("max_request_tokens", "http_limit_concurrency"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ServeConfigError(f"{name} must be >= 1 (or none), got {getattr(self, name)}")
        if self.api_keys_file is not None:
            self.tenant_book()  # a bad file fails here, naming the entry
        self._check_pool_bounds()
        self._check_resources()
        self._check_roles()
        if self.ingress_replicas < 1 or self.ingress_max_replicas is not None and \
                self.ingress_max_replicas < self.ingress_replicas:
            raise ServeConfigError(f"need 1 <= ingress_replicas ({self.ingress_replicas}) <= ingress_max_replicas "
                                   f"({self.ingress_max_replicas})")
        if self.engine.tensor_parallel_size != 1:
            raise ServeConfigError(f"engine.tensor_parallel_size={self.engine.tensor_parallel_size}: the server sets it per "
                                   "worker role; set prefill_tp and decode_tp instead")
        for name in ("prefill_tp", "decode_tp"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ServeConfigError(f"{name} must be an integer >= 1, got {v!r}")
        if max(self.prefill_tp, self.decode_tp) > 1 and not (self.worker_num_cpus > 0 or self.worker_num_gpus > 0):
            raise ServeConfigError("prefill_tp / decode_tp > 1 need worker_num_cpus or worker_num_gpus > 0: each rank's "
                                   "placement-group bundle holds that much")
        self.engine_config("decode")  # checks the engine fields too
        self.engine_config("prefill")

    def _check_roles(self) -> None:
        for name in ("ttft_target_ms", "tpot_target_ms"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ServeConfigError(f"{name} must be > 0 (or none), got {getattr(self, name)}")
        if not self.role_switching:
            return
        if self.colocated:
            raise ServeConfigError("role_switching needs a prefill pool (num_prefill_workers >= 1): colocated, every "
                                   "worker already does both")
        if self.prefill_tp != self.decode_tp:
            raise ServeConfigError(f"role_switching needs prefill_tp = decode_tp (a worker keeps its ranks when it "
                                   f"changes role), got {self.prefill_tp} and {self.decode_tp}")
        if self.prefill_resources != self.decode_resources:
            raise ServeConfigError("role_switching needs prefill_resources = decode_resources (a worker keeps its "
                                   "placement when it changes role)")

    def _check_resources(self) -> None:
        for name in ("prefill_resources", "decode_resources", "router_resources", "ingress_resources"):
            for key, amount in getattr(self, name).items():
                # NOTE: Ray takes CPUs, GPUs and memory only through num_cpus / num_gpus / memory, and
                # refuses them here only when the actor is created, long after the config was accepted.
                if key in ("CPU", "GPU", "memory", "object_store_memory"):
                    raise ServeConfigError(f"{name}: {key} is not a custom resource (use worker_num_cpus / "
                                           f"worker_num_gpus for the workers)")
                if not amount > 0:
                    raise ServeConfigError(f"{name}: the amount of {key!r} must be > 0, got {amount}")

    def _check_pool_bounds(self) -> None:
        for pool in ("prefill", "decode"):
            n = getattr(self, f"num_{pool}_workers")
            lo, hi = self.pool_bounds(pool)
            if self.colocated and pool == "prefill":
                if lo or hi:
                    raise ServeConfigError("with num_prefill_workers=0 (colocated) the prefill pool cannot scale: "
                                           f"prefill_min_workers ({lo}) and prefill_max_workers ({hi}) must be 0")
            elif not (1 <= lo <= n <= hi):
                raise ServeConfigError(f"need 1 <= {pool}_min_workers ({lo}) <= num_{pool}_workers ({n}) "
                                       f"<= {pool}_max_workers ({hi})")

    def tenant_book(self):
        """The tenants of `api_keys_file` (frontend/tenants.py), or None without one."""
        if self.api_keys_file is None:
            return None
        from deployments.frontend.tenants import TenantBook, TenantFileError

        try:
            return TenantBook.from_file(self.api_keys_file)
        except TenantFileError as e:
            raise ServeConfigError(str(e)) from None

    @property
    def routes_by_prefix(self) -> bool:
        return self.prefix_aware_routing and self.engine.enable_prefix_caching

    @property
    def backs_up_kv(self) -> bool:
        return self.kv_backup and self.routes_by_prefix and not self.colocated

    @property
    def fetches_prefix(self) -> bool:
        return self.kv_prefix_fetch and self.routes_by_prefix and not self.colocated

    @property
    def colocated(self) -> bool:
        """No prefill pool: every decode worker runs whole requests (chunked prefill mixed into its
        decode batch), as one engine would. Nothing moves over the KV transport."""
        return self.num_prefill_workers == 0

    def ingress_options(self) -> dict[str, Any]:
        """Serve deployment options for the ingress: a fixed replica count, or Serve's autoscaling on
        ongoing requests between `ingress_replicas` and `ingress_max_replicas`."""
        hi = self.ingress_max_replicas or self.ingress_replicas
        if hi == self.ingress_replicas:
            return {"num_replicas": self.ingress_replicas}
        return {"autoscaling_config": {"min_replicas": self.ingress_replicas, "initial_replicas": self.ingress_replicas,
                                       "max_replicas": hi,
                                       "target_ongoing_requests": self.ingress_target_ongoing_requests}}

    def ingress_actor_options(self) -> dict[str, Any]:
        """`ray_actor_options` of an ingress replica: no CPUs (the workers hold them, the ingress only
        relays) and `ingress_resources`, which pin it to the nodes that have them."""
        return {"num_cpus": 0, **({"resources": dict(self.ingress_resources)} if self.ingress_resources else {})}

    def pool_bounds(self, pool: str) -> tuple[int, int]:
        n = getattr(self, f"num_{pool}_workers")
        lo = getattr(self, f"{pool}_min_workers")
        hi = getattr(self, f"{pool}_max_workers")
        return (n if lo is None else lo), (n if hi is None else hi)

    def engine_config(self, role: str = "prefill") -> EngineConfig:
        """The engine settings of a `role` worker: a decode worker next to a prefill pool caps the
        prompt tokens of each step (`decode_max_prefill_tokens`); colocated, it is the whole engine.
        Its `tensor_parallel_size` is the role's `prefill_tp` / `decode_tp`."""
        cap = self.decode_max_prefill_tokens if role == "decode" and not self.colocated else None
        return replace(self.engine, max_prefill_tokens_per_step=cap, tensor_parallel_size=self.tp_size(role))

    def tp_size(self, role: str) -> int:
        """Tensor-parallel ranks of a `role` ("prefill" / "decode") worker."""
        return self.decode_tp if role == "decode" else self.prefill_tp

    @property
    def served_model_name(self) -> str:
        if self.model_name:
            return self.model_name
        if self.engine.model is None:
            from engine.model_loader import DEFAULT_MODEL_NAME

            return DEFAULT_MODEL_NAME
        return self.engine.model.rstrip("/").split("/")[-1].removesuffix(".gguf")

    @classmethod
    def from_dict(cls, args: dict[str, Any] | None) -> ServeConfig:
        """Build from a flat settings dict (`serve_config.yaml` args, `pdserve serve` flags): the names
        of `serve_settings()` (ServeConfig's own fields, EngineConfig's, their aliases), each value
        checked against its field's type. An `engine` dict (as `to_dict` writes it) is accepted too."""
        args = dict(args or {})
        engine_dict = dict(args.pop("engine", None) or {})
        try:
            engine = replace(DEFAULT_ENGINE, **engine_dict)
        except TypeError as exc:  # an unknown field in a hand-written `engine` dict
            raise ServeConfigError(f"engine: {exc}") from None
        by_key = {key: s for s in serve_settings() for key in s.keys}
        own: dict[str, Any] = {}
        engine_args: dict[str, Any] = {}
        given: dict[str, str] = {}  # field -> the key that set it
        for key, value in args.items():
            s = by_key.get(key)
            if s is None:
                raise ServeConfigError(_unknown_setting(key, by_key))
            if s.name in given:
                raise ServeConfigError(f"{key} and {given[s.name]} set the same setting: keep one")
            given[s.name] = key
            try:
                value = s.check(value)
            except ValueError as exc:
                raise ServeConfigError(f"{key}: {exc}") from None
            (engine_args if s.owner == "engine" else own)[s.name] = value
        if "dtype" not in engine_dict:
            # NOTE: DEFAULT_ENGINE resolved `auto` for its own device (CPU: float32); resolve it again for
            # the device given here, so `device: cuda` alone means bfloat16.
            engine_args.setdefault("dtype", "auto")
        return cls(engine=replace(engine, **engine_args), **own)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@functools.cache
def serve_settings() -> tuple[Setting, ...]:
    """Every server setting: ServeConfig's own fields, then the engine's (flattened, with the server's
    default engine), less those the server sets itself (`SERVER_SET`)."""
    defaults = ServeConfig()
    return (*settings_of(ServeConfig, "serve", defaults, ALIASES, skip=frozenset({"engine"})),
            *settings_of(EngineConfig, "engine", defaults.engine, ALIASES, skip=frozenset(SERVER_SET)))


def _unknown_setting(key: str, by_key: dict[str, Setting]) -> str:
    if key in SERVER_SET:
        return f"{key} is set per worker role by the server: set {SERVER_SET[key]} instead"
    near = difflib.get_close_matches(key, list(by_key), n=3)
    hint = f"did you mean {' or '.join(near)}? " if near else ""
    return f"unknown setting {key!r}: {hint}docs/reference/settings.md lists them all"
