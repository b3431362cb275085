"""`pdserve serve`: start (or join) Ray, deploy the app, print the URL, serve until Ctrl-C.

Its flags are made from the settings dataclasses (`deployments.config_fields`): every
`ServeConfig` / `EngineConfig` field `foo_bar` is `--foo-bar`, the same name as the `foo_bar` key of
`serve_config.yaml`; `LaunchOptions` adds the few that only say how to start Ray and Serve."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from deployments.config_fields import Kind, Setting, settings_of

if TYPE_CHECKING:
    from deployments.config import ServeConfig

_GROUPS = {"launch": "starting Ray and Serve", "serve": "server", "engine": "engine of every worker",
           "scaling": "autoscaling and failures (see README \"Scaling and failures\")"}
_METAVARS = {Kind.INT: "N", Kind.FLOAT: "X", Kind.STR: "STR", Kind.RESOURCES: "JSON"}


@dataclass(frozen=True, slots=True)
class LaunchOptions:
    """How `pdserve serve` starts Ray and Serve: command-line flags only, not app settings (in
    `serve_config.yaml`, Serve's own `grpc_options` says the same)."""

    # NOTE: plain metadata here, not engine.config.setting: importing the engine imports torch, which
    # `pdserve bench` (that builds this CLI too) does not need.
    address: str | None = field(default=None, metadata={
        "help": "join this Ray cluster (e.g. auto) instead of starting one", "default_doc": "start one"})
    grpc_port: int = field(default=9000, metadata={"help": "gRPC port (0: no gRPC service)"})
    cluster_resources: bool = field(default=False, metadata={
        "help": "pin the workers to nodes with the prefill / decode custom resources of cluster.yaml "
                "(sets prefill_resources / decode_resources unless given)"})


def launch_settings() -> list[Setting]:
    return settings_of(LaunchOptions, "launch", LaunchOptions())


def _add_flag(group: Any, s: Setting) -> None:
    """Add `s` to an argparse argument group: its flags (aliases included) set the field's name."""
    # NOTE: defaults are SUPPRESSed so only the flags given reach `ServeConfig.from_dict`, which fills
    # in the rest exactly as it does for YAML. argparse %-formats help texts.
    kw = dict(dest=s.name, default=argparse.SUPPRESS,
              help=f"{s.help} (default: {s.default_text()})".replace("%", "%%"))
    if s.kind is Kind.BOOL:
        group.add_argument(*s.flags, action=argparse.BooleanOptionalAction, **kw)
        return

    def parse(text: str, s: Setting = s) -> object:
        try:
            return s.parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    group.add_argument(*s.flags, type=parse, metavar=_METAVARS.get(s.kind, "{" + ",".join(s.choices) + "}"), **kw)


def add_serve_parser(sub, flags: bool = True) -> None:
    """Add `serve` to the subcommands `sub`; `flags=False`: without its flags (no engine import)."""
    s = sub.add_parser("serve", help="start the OpenAI-compatible server (Ray + Serve)",
                       usage="pdserve serve [--SETTING VALUE ...]  (pdserve serve --help lists them)",
                       description="Every setting is also a key of serve_config.yaml / build_app(args), the "
                                   "same name with underscores (--max-num-seqs: max_num_seqs). `none` (YAML: null) "
                                   "unsets an optional number, e.g. --decode-max-prefill-tokens none.")
    s.set_defaults(func=_serve)
    if not flags:
        return
    from deployments.config import serve_settings

    groups = {name: s.add_argument_group(title) for name, title in _GROUPS.items()}
    for setting_ in (*launch_settings(), *serve_settings()):
        if setting_.cli:
            _add_flag(groups[setting_.group], setting_)


def split_args(args: argparse.Namespace) -> tuple[LaunchOptions, dict[str, Any]]:
    """The launcher's options and the settings dict (`ServeConfig.from_dict`) of parsed flags: only
    the flags given, plus `$PDSERVE_API_KEY` and what `--cluster-resources` stands for."""
    launch_names = {s.name for s in launch_settings()}
    given = {k: v for k, v in vars(args).items() if k not in ("cmd", "func")}
    launch = LaunchOptions(**{k: v for k, v in given.items() if k in launch_names})
    settings = {k: v for k, v in given.items() if k not in launch_names}
    if os.environ.get("PDSERVE_API_KEY"):
        settings.setdefault("api_key", os.environ["PDSERVE_API_KEY"])
    if launch.cluster_resources:
        settings.setdefault("prefill_resources", {"prefill": 0.01})
        settings.setdefault("decode_resources", {"decode": 0.01})
    return launch, settings


def _free_port(host: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _serve(args: argparse.Namespace) -> int:
    from deployments.config import ServeConfig, direct_ingress_env

    launch, settings = split_args(args)
    cfg = ServeConfig.from_dict(settings)  # a bad setting stops here, before Ray starts (cli.main: exit 2)
    proxy_port = cfg.http_port
    if cfg.direct_ingress:
        di_env = direct_ingress_env(cfg.http_port, cfg.direct_ingress_ports())
        if launch.address and any(os.environ.get(k) != v for k, v in di_env.items()):
            print("pdserve: --direct-ingress on an existing cluster needs, on every node, the environment "
                  + " ".join(f"{k}={v}" for k, v in di_env.items()), file=sys.stderr)
            return 2
        os.environ.update(di_env)
        proxy_port = _free_port(cfg.http_host)
    _start(launch, cfg, proxy_port)
    _wait_for_stop()
    return 0


def _start(launch: LaunchOptions, cfg: ServeConfig, proxy_port: int) -> None:
    """Start (or join) Ray, start Serve, deploy the HTTP (and gRPC) app, and print where it serves."""
    import ray
    from ray import serve

    from deployments.app import build_app, build_grpc_app
    from deployments.config import apply_ray_env_defaults
    from deployments.frontend.grpc_app import grpc_options

    if launch.address:
        ray.init(address=launch.address)
    else:
        apply_ray_env_defaults()
        needed = int((cfg.num_prefill_workers + cfg.num_decode_workers) * cfg.worker_num_cpus + 0.999)
        ray.init(num_cpus=max(needed, os.cpu_count() or 1), include_dashboard=False)
    serve.start(http_options={"host": cfg.http_host, "port": proxy_port},
                grpc_options=grpc_options(launch.grpc_port) if launch.grpc_port else None)
    t0 = time.perf_counter()
    pools = (f"{cfg.num_decode_workers} colocated worker(s) (no prefill pool)" if cfg.colocated else
             f"{cfg.num_prefill_workers} prefill + {cfg.num_decode_workers} decode workers")
    print(f"pdserve: starting {pools} for {cfg.served_model_name} ...", flush=True)
    serve.run(build_app(cfg.to_dict()), name="pdserve", route_prefix="/")
    if launch.grpc_port:
        serve.run(build_grpc_app(cfg.to_dict()), name="pdserve-grpc", route_prefix="/pdserve-grpc")
    url = f"http://{cfg.http_host}:{cfg.http_port}"
    print(f"pdserve: ready in {time.perf_counter() - t0:.0f}s at {url}/v1  (model: {cfg.served_model_name})", flush=True)
    print(f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
          f"-d '{{\"model\": \"{cfg.served_model_name}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hi\"}}]}}'",
          flush=True)
    if launch.grpc_port:
        print(f"  gRPC: pdserve.Generation/Generate on {cfg.http_host}:{launch.grpc_port} "
              "(metadata application=pdserve-grpc)", flush=True)
    if cfg.direct_ingress:
        print(f"  direct ingress: the ingress replica serves {url}; Serve's proxy is on port {proxy_port}",
              flush=True)


def _wait_for_stop() -> None:
    """Serve until Ctrl-C or SIGTERM, then take down Serve, the router with its workers, and Ray."""
    import ray
    from ray import serve

    from deployments.app import shutdown_router

    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    try:
        while not stop:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    print("pdserve: shutting down", flush=True)
    serve.shutdown()
    shutdown_router()
    ray.shutdown()
