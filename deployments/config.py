"""Serving settings: one frozen dataclass, checked when built, shared by the CLI, the app builder and
the actors. Every field is documented in README.md ("Server settings")."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from engine import EngineConfig
from engine.errors import EngineConfigError


# Ray settings for a Ray instance pdserve starts itself (an existing cluster keeps its own). Serve's
# controller loop runs every 0.1 s by default; here it only watches the ingress replicas (the router
# scales the worker pools), and on a small CPU node every 0.1 s cost 2.5% of a core, time taken from
# the engine's threads.
RAY_ENV_DEFAULTS = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "1.0"}


def apply_ray_env_defaults() -> None:
    """Set `RAY_ENV_DEFAULTS` in this process's environment (not overriding the user's) before
    `ray.init` starts a local Ray, whose processes inherit it."""
    for k, v in RAY_ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)


def direct_ingress_env(http_port: int, num_ports: int) -> dict[str, str]:
    """Environment for Ray Serve's direct ingress: every HTTP ingress replica serves HTTP itself, on
    a port of [http_port, http_port + num_ports) (the first replica to start gets `http_port`),
    instead of behind Serve's proxy. Ray reads it when Serve's controller and replicas start, so it
    must be in the environment of the processes Ray starts (`pdserve serve` sets it before it starts
    Ray; on an existing cluster set it on every node).

    NOTE: the proxy relays every streamed chunk between two processes. On 2 CPU cores that cost
    ~1.5 ms of CPU per output token, 14-15% of the engine's throughput; with direct ingress the
    serving layer costs a few percent (benchmarks/serving_overhead.py)."""
    return {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
            "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(http_port),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(http_port + num_ports)}


@dataclass(frozen=True, slots=True)
class ServeConfig:
    # Every worker's engine settings (model, dtype, KV cache, batch limits, threads); a decode worker
    # next to a prefill pool also gets `decode_max_prefill_tokens` (`engine_config`).
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(num_threads=1))
    model_name: str | None = None  # the name clients pass as `model`; default: derived from the model
    # 0 prefill workers: colocated (aggregated) serving, each decode worker prefills its own prompts.
    num_prefill_workers: int = 1
    num_decode_workers: int = 1
    # Resources per worker actor: on a GPU cluster num_gpus=1 and the custom resources pin node types.
    worker_num_cpus: float = 1.0
    worker_num_gpus: float = 0.0
    prefill_resources: dict[str, float] = field(default_factory=dict)
    decode_resources: dict[str, float] = field(default_factory=dict)
    # With a prefill pool: prompt tokens a decode worker computes per step (local prefills; an urgent
    # recompute of a moved sequence is not held to it), so its running sequences keep streaming.
    # None: max_num_batched_tokens.
    # NOTE: 128, not 256: on a CPU thread a 256-token chunk takes ~0.7 s, a gap every client of that
    # worker sees, and the gap a dead worker's clients had already waited before their sequences move.
    # Measured (fault_figures, 1P+2D on 2 cores): the longest stall after a kill met its target in 4 of
    # 8 kills at 128 against 1 of 6 at 256, with the same throughput (serving_overhead, 3 passes).
    decode_max_prefill_tokens: int | None = 128
    # Conditional disaggregation: a prompt of at most this many tokens is prefilled on a decode worker
    # when that would start it sooner than the prefill pool's queue would. 0: always the prefill pool.
    local_prefill_max_tokens: int = 512
    # The router sends each prompt where its prefix is likely cached (weighed against the queues).
    # Routing needs the engines' prefix caching (engine.enable_prefix_caching).
    prefix_aware_routing: bool = True
    # A prompt a decode worker computed itself (a local prefill, a moved sequence) is copied over the KV
    # transport into a prefill worker's prefix cache. If that decode worker dies, its sequence is then
    # recomputed from the end of its prompt, not from its first token. Needs prefix-aware routing.
    kv_backup: bool = True
    # A dead decode worker's sequence may resume on another decode worker that pulls the prompt's KV
    # from the prefill worker caching it (its prompt, or a KV backup), so only the tokens generated
    # since are recomputed there, without waiting for the prefill worker's step under way.
    kv_prefix_fetch: bool = True
    # Router: requests admitted but not yet decoding, beyond which new ones get 429.
    max_queued_requests: int = 256
    kv_lease_s: float = 60.0
    kv_transfer_timeout_s: float = 30.0
    # A request that has produced nothing for this long ends with an error instead of hanging.
    request_timeout_s: float = 300.0
    # Autoscaling by queue depth (off unless a max exceeds its pool's start size).
    prefill_min_workers: int | None = None  # default: num_prefill_workers
    prefill_max_workers: int | None = None
    decode_min_workers: int | None = None
    decode_max_workers: int | None = None
    prefill_target_queued_tokens: int = 2048  # queued prompt tokens per prefill worker
    decode_target_waiting: int = 4  # sequences waiting for a decode slot, per decode worker
    decode_target_kv_use: float = 0.85  # KV-block use per decode worker
    upscale_delay_s: float = 2.0  # a scale-up signal must hold this long
    downscale_delay_s: float = 15.0  # a scale-down signal must hold this long
    autoscale_interval_s: float = 0.5
    # A worker that does not answer a ping within this long is treated as dead.
    health_check_timeout_s: float = 10.0
    api_key: str | None = None
    http_host: str = "127.0.0.1"
    http_port: int = 8000
    ingress_replicas: int = 1
    # Serve autoscales the ingress on ongoing requests per replica when this exceeds ingress_replicas.
    ingress_max_replicas: int | None = None
    ingress_target_ongoing_requests: float = 64.0
    # Ray Serve direct ingress: the ingress replica serves HTTP on http_port itself, no proxy hop.
    direct_ingress: bool = False

    def direct_ingress_ports(self) -> int:
        """HTTP ports direct ingress may hand out: one per ingress replica of the HTTP and of the gRPC
        app (Serve gives every ingress replica one, the first goes to `http_port`)."""
        return 2 * (self.ingress_max_replicas or self.ingress_replicas)

    def __post_init__(self) -> None:
        if not isinstance(self.engine, EngineConfig):
            raise EngineConfigError(f"engine must be an EngineConfig, got {type(self.engine).__name__}")
        if self.engine.num_threads is not None and self.engine.num_threads < 1:
            raise EngineConfigError(f"num_threads must be >= 1, got {self.engine.num_threads}")
        for name in ("num_decode_workers", "max_queued_requests"):
            if getattr(self, name) < 1:
                raise EngineConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_prefill_workers < 0:
            raise EngineConfigError(f"num_prefill_workers must be >= 0 (0: colocated), got {self.num_prefill_workers}")
        if self.worker_num_cpus < 0 or self.worker_num_gpus < 0:
            raise EngineConfigError("worker_num_cpus / worker_num_gpus must be >= 0")
        if self.local_prefill_max_tokens < 0:
            raise EngineConfigError(f"local_prefill_max_tokens must be >= 0 (0: off), got {self.local_prefill_max_tokens}")
        for name in ("kv_lease_s", "kv_transfer_timeout_s", "request_timeout_s"):
            if getattr(self, name) <= 0:
                raise EngineConfigError(f"{name} must be > 0")
        for pool in ("prefill", "decode"):
            n = getattr(self, f"num_{pool}_workers")
            lo, hi = self.pool_bounds(pool)
            if self.colocated and pool == "prefill":
                if lo or hi:
                    raise EngineConfigError("with num_prefill_workers=0 (colocated) the prefill pool cannot scale: "
                                            f"prefill_min_workers ({lo}) and prefill_max_workers ({hi}) must be 0")
            elif not (1 <= lo <= n <= hi):
                raise EngineConfigError(f"need 1 <= {pool}_min_workers ({lo}) <= num_{pool}_workers ({n}) "
                                        f"<= {pool}_max_workers ({hi})")
        if self.ingress_replicas < 1 or self.ingress_max_replicas is not None and \
                self.ingress_max_replicas < self.ingress_replicas:
            raise EngineConfigError(f"need 1 <= ingress_replicas ({self.ingress_replicas}) <= ingress_max_replicas "
                                    f"({self.ingress_max_replicas})")
        if self.ingress_target_ongoing_requests <= 0:
            raise EngineConfigError("ingress_target_ongoing_requests must be > 0")
        if self.upscale_delay_s < 0 or self.downscale_delay_s < 0 or self.autoscale_interval_s <= 0:
            raise EngineConfigError("upscale_delay_s / downscale_delay_s must be >= 0, autoscale_interval_s > 0")
        self.engine_config("decode")  # checks the engine fields too

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

    def pool_bounds(self, pool: str) -> tuple[int, int]:
        n = getattr(self, f"num_{pool}_workers")
        lo = getattr(self, f"{pool}_min_workers")
        hi = getattr(self, f"{pool}_max_workers")
        return (n if lo is None else lo), (n if hi is None else hi)

    def engine_config(self, role: str = "prefill") -> EngineConfig:
        """The engine settings of a `role` worker: a decode worker next to a prefill pool caps the
        prompt tokens of each step (`decode_max_prefill_tokens`); colocated, it is the whole engine."""
        cap = self.decode_max_prefill_tokens if role == "decode" and not self.colocated else None
        return replace(self.engine, max_prefill_tokens_per_step=cap)

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
        """Build from a flat settings dict (`serve run` args): ServeConfig's own names and
        EngineConfig's, side by side; an `engine` dict (as `to_dict` writes it) is accepted too.
        Aliases `prefill_workers` / `decode_workers` / `threads_per_worker` are accepted."""
        args = dict(args or {})
        aliases = {"prefill_workers": "num_prefill_workers", "decode_workers": "num_decode_workers",
                   "threads_per_worker": "num_threads"}
        for a, real in aliases.items():
            if a in args:
                args[real] = args.pop(a)
        engine_args = dict(args.pop("engine", None) or {})
        engine_names = {f.name for f in fields(EngineConfig)}
        own = {f.name for f in fields(cls)} - {"engine"}
        for name in list(args):
            if name in engine_names:
                engine_args[name] = args.pop(name)
        unknown = sorted(set(args) - own)
        if unknown:
            raise EngineConfigError(f"unknown setting(s) {unknown}; valid: {sorted(own | engine_names)}")
        engine_args.setdefault("num_threads", 1)
        return cls(engine=EngineConfig(**engine_args), **args)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
