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
from typing import TYPE_CHECKING, Any, Literal

from deployments.config_fields import Kind, Setting, settings_of
from deployments.console import print_ready, process_map
from deployments.layouts import cluster_hardware, conflict, local_hardware, ray_only_settings, resolve

if TYPE_CHECKING:
    from deployments.config import ServeConfig

_GROUPS = {"launch": "starting Ray and Serve", "serve": "server", "engine": "engine of every worker",
           "scaling": "autoscaling and failures (see docs/guides/scaling-and-failures.md)",
           "roles": "workers that change role (see docs/guides/role-switching.md)"}
_METAVARS = {Kind.INT: "N", Kind.FLOAT: "X", Kind.STR: "STR", Kind.RESOURCES: "JSON"}
@dataclass(frozen=True, slots=True)
class LaunchOptions:
    """How `pdserve serve` starts Ray and Serve: command-line flags only, not app settings (in
    `serve_config.yaml`, Serve's own `grpc_options` says the same)."""

    # NOTE: plain metadata here, not engine.config.setting: importing the engine imports torch, which
    # `pdserve bench` (that builds this CLI too) does not need.
    address: str | None = field(default=None, metadata={
        "help": "join this Ray cluster (e.g. auto) instead of starting one", "default_doc": "start one"})
    grpc_port: int = field(default=0, metadata={
        "help": "gRPC port (0: no gRPC service); needs --http-host 0.0.0.0 or ::, since Serve's gRPC proxy "
                "listens on every interface"})
    layout: Literal["auto", "single", "colocated", "disagg", "ray"] = field(default="auto", metadata={
        "help": "single: the HTTP server and one engine in this process, no Ray; colocated: Ray, decode workers "
                "that prefill too; disagg: Ray, a prefill pool and a decode pool with KV transfer between them; "
                "auto: the fastest of these for this hardware (docs/guides/layouts.md); ray: deprecated, "
                "colocated (disagg with --prefill-workers)"})
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


# NOTE: Ray Serve's gRPC proxy takes no host: it listens on `[::]:<port>`, every interface
# (ray/serve/_private/grpc_util.py, `start_grpc_server`; `gRPCOptions` has only a port).
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def grpc_bind_error(http_host: str, grpc_port: int) -> str | None:
    """Why gRPC cannot be served beside HTTP on `http_host` (None: it can). gRPC would listen on every
    interface, so it is served only where HTTP does too: never exposed beside a loopback-only HTTP."""
    if not grpc_port or http_host in WILDCARD_HOSTS:
        return None
    return (f"--grpc-port {grpc_port} with --http-host {http_host}: Ray Serve's gRPC proxy cannot bind one "
            "address (it listens on every interface), so gRPC would be exposed where HTTP is not. Pass "
            "--http-host 0.0.0.0 (or ::) to serve both on every interface, or --grpc-port 0")


def http_port_error(host: str, port: int) -> str | None:
    """Why `pdserve serve` cannot listen on host:port (None: it can). Checked before Ray starts: with
    direct ingress, Serve would otherwise move the replica to the next free port, and the URL printed
    at start would not be the one served."""
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return f"cannot listen on {host}:{port} ({exc.strerror or exc}); pass a free --port"
    return None


# How long the door may take to answer through the advertised address once Serve says the app is
# deployed: Serve retries a failed bind on its own (seen: "Failed to bind ... Retrying", never
# recovering), so this bounds that wait.
DOOR_ANSWER_TIMEOUT_S = 60.0


def door_answer_error(url: str, timeout_s: float = DOOR_ANSWER_TIMEOUT_S, poll_s: float = 0.5) -> str | None:
    """Why `GET {url}/health` did not answer 200 within `timeout_s` (None: it did). A wildcard bind
    address is probed on loopback. Every try is bounded; a refused connection or a 5xx is retried."""
    import httpx

    scheme, rest = url.split("://", 1)
    host, port = rest.rsplit(":", 1)
    if host in ("0.0.0.0", "::", "[::]"):
        host = "127.0.0.1" if host == "0.0.0.0" else "[::1]"
    probe = f"{scheme}://{host}:{port}/health"
    deadline = time.monotonic() + timeout_s
    last = "nothing tried"
    while True:
        try:
            # trust_env off: a user's HTTP(S)_PROXY must not carry a probe of this host's own port
            r = httpx.get(probe, timeout=min(5.0, max(timeout_s, 0.1)), trust_env=False)
            if r.status_code == 200:
                return None
            last = f"HTTP {r.status_code}"
        except httpx.HTTPError as exc:
            last = type(exc).__name__
        if time.monotonic() + poll_s > deadline:
            return f"nothing answered {probe} within {timeout_s:.0f} s (last: {last})"
        time.sleep(poll_s)


def _free_port(host: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def ray_reasons(launch: LaunchOptions, settings: dict[str, Any]) -> list[str]:
    """What in the command line only a Ray layout can do (flags as typed); empty: single can serve it."""
    from deployments.config import serve_settings

    flags = {s.name: s.flags[0] for s in serve_settings()}
    out = [flags.get(k, k) for k in ray_only_settings(settings)]
    if launch.address:
        out.append("--address")
    if launch.grpc_port:
        out.append("--grpc-port")
    if launch.cluster_resources:
        out.append("--cluster-resources")
    return out


def _refusal(layout: str, launch: LaunchOptions, settings: dict[str, Any]) -> str | None:
    """Why `--layout layout` cannot serve this command line (None: it can)."""
    if layout == "single" and (why := ray_reasons(launch, settings)):
        return (f"--layout single serves one engine in this process, without Ray; {', '.join(why)} needs Ray: "
                "drop it, or pass --layout colocated or --layout disagg")
    return conflict(layout, settings)


def _serve(args: argparse.Namespace) -> int:
    from deployments.config import ServeConfig, direct_ingress_env
    from deployments.http_limits import proxy_limits_error

    launch, settings = split_args(args)
    if launch.layout == "ray":
        print("pdserve: --layout ray is deprecated: say --layout colocated, or --layout disagg for a prefill "
              "pool", file=sys.stderr, flush=True)
    if why := _refusal(launch.layout, launch, settings):
        print(f"pdserve: {why}", file=sys.stderr)
        return 2
    if launch.address:  # a cluster joined: its layout is picked for its nodes
        import ray

        ray.init(address=launch.address)
    hw = cluster_hardware() if launch.address else local_hardware()
    layout, settings = resolve(launch.layout, settings, hw, needs_ray=bool(ray_reasons(launch, settings)))
    # NOTE: direct ingress unless told otherwise where pdserve starts Ray itself (it can set Ray's
    # variables) and one ingress replica serves: more would share the proxy's port no more.
    if layout != "single" and not launch.address and "direct_ingress" not in settings and \
            (settings.get("ingress_max_replicas") or settings.get("ingress_replicas", 1)) == 1:
        settings["direct_ingress"] = True
    cfg = ServeConfig.from_dict(settings)  # the one parse: a bad setting stops here (cli.main: exit 2)
    if layout != "single" and not cfg.direct_ingress and (why := proxy_limits_error(cfg)):
        print(f"pdserve: {why}", file=sys.stderr)
        return 2
    if why := grpc_bind_error(cfg.http_host, launch.grpc_port):
        print(f"pdserve: {why}", file=sys.stderr)
        return 2
    if not launch.address and (why := http_port_error(cfg.http_host, cfg.http_port)):
        print(f"pdserve: {why}", file=sys.stderr)
        return 2
    print(process_map(layout, cfg), flush=True)
    if layout == "single":
        from deployments.local_server import serve_single_process

        serve_single_process(cfg)
        return 0
    proxy_port = cfg.http_port
    if cfg.direct_ingress:
        di_env = direct_ingress_env(cfg.http_port, cfg.direct_ingress_ports(), cfg.ingress_drain_s)
        if launch.address and any(os.environ.get(k) != v for k, v in di_env.items()):
            print("pdserve: --direct-ingress on an existing cluster needs, on every node, the environment "
                  + " ".join(f"{k}={v}" for k, v in di_env.items()), file=sys.stderr)
            return 2
        os.environ.update(di_env)
        proxy_port = _free_port(cfg.http_host)
    if not _start(launch, cfg, proxy_port):
        _stop()
        return 3
    _wait_for_stop()
    return 0


def _start(launch: LaunchOptions, cfg: ServeConfig, proxy_port: int) -> bool:
    """Start Ray (unless joined), start Serve, deploy the HTTP (and gRPC) app, and print where it
    serves once a request through that address was answered. False: it never was (said on stderr,
    naming the port); the caller takes everything down and exits non-zero."""
    import ray
    from ray import serve

    from deployments.app import build_app, build_grpc_app
    from deployments.config import apply_ray_env_defaults
    from deployments.frontend.grpc_app import grpc_options

    if not launch.address:
        apply_ray_env_defaults()
        needed = int((cfg.num_prefill_workers + cfg.num_decode_workers) * cfg.worker_num_cpus + 0.999)
        ray.init(num_cpus=max(needed, os.cpu_count() or 1), include_dashboard=False)
        print(f"pdserve: Ray at {ray_access_line()}", flush=True)
    from deployments.http_limits import proxy_keepalive_s

    # NOTE: Serve's proxy takes whole seconds; with direct ingress the replica's own server gets the
    # exact value (deployments/http_limits.py).
    serve.start(http_options={"host": cfg.http_host, "port": proxy_port,
                              "keep_alive_timeout_s": proxy_keepalive_s(cfg)},
                grpc_options=grpc_options(launch.grpc_port) if launch.grpc_port else None)
    t0 = time.perf_counter()
    print(f"pdserve: starting the workers for {cfg.served_model_name} ...", flush=True)
    serve.run(build_app(cfg), name="pdserve", route_prefix="/")
    if launch.grpc_port:
        serve.run(build_grpc_app(cfg), name="pdserve-grpc", route_prefix="/pdserve-grpc")
    url = f"http://{cfg.http_host}:{cfg.http_port}"
    if why := door_answer_error(url):
        print(f"pdserve: the HTTP door is not serving port {cfg.http_port}: {why}. Stopping.", file=sys.stderr,
              flush=True)
        return False
    print_ready(url, cfg.served_model_name, time.perf_counter() - t0)
    if launch.grpc_port:
        print(f"  gRPC: pdserve.Generation/Generate on port {launch.grpc_port} of every interface "
              "(metadata application=pdserve-grpc)", flush=True)
    if cfg.direct_ingress:
        print(f"  direct ingress: the ingress replica serves {url}; Serve's proxy is on port {proxy_port}",
              flush=True)
    return True


def ray_access_line() -> str:
    """Where this process's Ray listens and whether it asks for a token: Ray turns token
    authentication on by default for the clusters `ray.init` starts (pdserve keeps it so); a client,
    `pdserve serve --address` included, joins with RAY_AUTH_MODE=token and the token in
    ~/.ray/auth_token (or RAY_AUTH_TOKEN)."""
    import ray

    on = os.environ.get("RAY_AUTH_MODE", "").lower() == "token"
    return (f"{ray.get_runtime_context().gcs_address}, token authentication "
            + ("on (joining needs RAY_AUTH_MODE=token and the token in ~/.ray/auth_token)" if on
               else "OFF (RAY_AUTH_MODE says so): anyone who reaches this port can run code here"))


def _wait_for_stop() -> None:
    """Serve until Ctrl-C or SIGTERM, then take down Serve, the router with its workers, and Ray."""
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    try:
        while not stop:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    print("pdserve: shutting down", flush=True)
    _stop()


def _stop() -> None:
    """Take down Serve, the router with its workers, and Ray (this process's connection to it)."""
    import ray
    from ray import serve

    from deployments.app import shutdown_router

    serve.shutdown()
    shutdown_router()
    ray.shutdown()
