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
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from deployments.config_fields import Kind, Setting, settings_of

if TYPE_CHECKING:
    from deployments.config import ServeConfig

_GROUPS = {"launch": "starting Ray and Serve", "serve": "server", "engine": "engine of every worker",
           "scaling": "autoscaling and failures (see docs/guides/scaling-and-failures.md)"}
_METAVARS = {Kind.INT: "N", Kind.FLOAT: "X", Kind.STR: "STR", Kind.RESOURCES: "JSON"}
# The most cores on which `pdserve serve` picks the single-process layout: there the Ray layouts' own
# processes take a share of the engine's cores that costs it 20-30% (docs/guides/layouts.md).
SINGLE_PROCESS_MAX_CPUS = 4


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
    layout: Literal["auto", "single", "ray"] = field(default="auto", metadata={
        "help": "single: the engine and the HTTP server in this one process, no Ray; ray: Ray Serve with the "
                "router and worker pools (the layout flags shape them); auto: single on a CPU-only host of at "
                f"most {SINGLE_PROCESS_MAX_CPUS} cores when no setting asks for Ray, else ray (docs/guides/layouts.md)"})
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


def _free_port(host: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# The settings that make up a layout: given any of them, `pdserve serve` picks none itself.
LAYOUT_SETTINGS = frozenset({"num_prefill_workers", "num_decode_workers", "num_threads", "worker_num_cpus",
                             "worker_num_gpus", "prefill_resources", "decode_resources"})


class Hardware(NamedTuple):
    """What `pdserve serve` serves on: CPU cores per node, GPUs in all, nodes, and the CPU's instructions
    that multiply bf16 matrices in hardware ("AMX", "AVX512-BF16"; "" for none)."""

    cpus: int
    gpus: int
    nodes: int = 1
    cpu_bf16: str = ""


# /proc/cpuinfo flag -> the name printed; the first found wins. AMX tiles: 4-6x fp32's rate at
# SmolLM2's shapes; AVX512-BF16 dot products (Zen 4, Cooper Lake): 2.0-2.3x (docs/guides/layouts.md).
BF16_FLAGS = (("amx_bf16", "AMX"), ("avx512_bf16", "AVX512-BF16"))


def cpu_bf16(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The instructions this CPU multiplies bf16 matrices with ("" for none; Linux: its cpuinfo flags)."""
    try:
        with open(cpuinfo) as f:
            flags = next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return ""
    return next((name for flag, name in BF16_FLAGS if flag in flags), "")


def local_hardware() -> Hardware:
    """This host: the cores this process may run on, its CUDA devices, and its bf16 instructions."""
    import torch

    return Hardware(len(os.sched_getaffinity(0)), torch.cuda.device_count() if torch.cuda.is_available() else 0,
                    cpu_bf16=cpu_bf16())


def cluster_hardware() -> Hardware:
    """The Ray cluster joined (`--address`): the smallest node's CPUs, every GPU, the nodes."""
    import ray

    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    return Hardware(int(min((n.get("CPU", 1) for n in nodes), default=1)),
                    int(sum(n.get("GPU", 0) for n in nodes)), max(1, len(nodes)))


def pick_layout(hw: Hardware) -> tuple[dict[str, Any], str]:
    """The layout that serves best on `hw` (docs/guides/layouts.md), and a line that says it.

    - CPUs only: colocated, one worker per node with a thread per core. Split between two pools, the
      cores of a small node are lost to whichever pool idles (measured: docs/guides/layouts.md).
    - One GPU: colocated on it (prefill and decode share the device anyway).
    - Two GPUs or more: disaggregated, half of them prefill workers, the rest decode workers."""
    if hw.gpus >= 2:
        prefill = hw.gpus // 2
        return ({"num_prefill_workers": prefill, "num_decode_workers": hw.gpus - prefill, "worker_num_gpus": 1.0,
                 "worker_num_cpus": 1.0, "device": "cuda"},
                f"disaggregated, {prefill} prefill + {hw.gpus - prefill} decode workers, one GPU each")
    if hw.gpus == 1:
        return ({"num_prefill_workers": 0, "num_decode_workers": 1, "worker_num_gpus": 1.0, "worker_num_cpus": 1.0,
                 "device": "cuda"}, "colocated, 1 worker on the GPU")
    return ({"num_prefill_workers": 0, "num_decode_workers": hw.nodes, "num_threads": hw.cpus,
             "worker_num_cpus": float(hw.cpus)},
            f"colocated, {hw.nodes} worker{'s' * (hw.nodes > 1)} x {hw.cpus} thread{'s' * (hw.cpus > 1)}")


def ray_reasons(launch: LaunchOptions, settings: dict[str, Any]) -> list[str]:
    """What in the command line only a Ray layout can do (flags as typed); empty: single can serve it."""
    from deployments.config import serve_settings
    from deployments.local_server import ray_only_settings

    flags = {s.name: s.flags[0] for s in serve_settings()}
    out = [flags.get(k, k) for k in ray_only_settings(settings)]
    if launch.address:
        out.append("--address")
    if launch.grpc_port:
        out.append("--grpc-port")
    if launch.cluster_resources:
        out.append("--cluster-resources")
    return out


def picks_single_process(launch: LaunchOptions, settings: dict[str, Any], hw: Hardware) -> bool:
    """Whether `pdserve serve` serves in one process: told so, or `auto` on a CPU-only host of at most
    SINGLE_PROCESS_MAX_CPUS cores with nothing in the command line that needs Ray."""
    if launch.layout != "auto":
        return launch.layout == "single"
    on_cpu = hw.gpus == 0 or not str(settings.get("device", "cuda")).startswith("cuda")
    return on_cpu and hw.cpus <= SINGLE_PROCESS_MAX_CPUS and not ray_reasons(launch, settings)


def with_single_process(settings: dict[str, Any], hw: Hardware, picked: bool) -> dict[str, Any]:
    """`settings` for the single-process layout on `hw`: a torch thread per core unless told, the
    dtype for `hw`; prints what it picked (`picked`: chosen by `auto`)."""
    out = dict(settings)
    out.setdefault("num_threads", hw.cpus)
    if picked:
        n = out["num_threads"]
        print(f"pdserve: layout for {_hardware_text(hw)}: single process, the engine ({n} thread{'s' * (n > 1)}) "
              "and the HTTP server in this process, no Ray; --layout ray serves through Ray (a colocated worker; "
              "--prefill-workers 1 --decode-workers 1: disaggregated)", flush=True)
    return _with_dtype(out, settings, hw)


def _hardware_text(hw: Hardware) -> str:
    gpus = f"{hw.gpus} GPU{'s' * (hw.gpus != 1)}" if hw.gpus else "no GPU"
    node = f"{hw.nodes} nodes x {hw.cpus}" if hw.nodes > 1 else f"{hw.cpus}"
    return f"{node} CPU core{'s' * (hw.cpus != 1)}, {gpus}"


def pick_dtype(hw: Hardware, device: str) -> str | None:
    """The dtype `pdserve serve` picks when none is given: bfloat16 on a CPU that multiplies bf16
    matrices in hardware (AMX, AVX512-BF16), 2-6x faster than fp32 ones (docs/guides/layouts.md);
    else None, the engine's `auto` (bfloat16 on CUDA, float32 on other CPUs, which emulate bf16)."""
    return "bfloat16" if not device.startswith("cuda") and hw.cpu_bf16 else None


def with_layout(settings: dict[str, Any], hw: Hardware) -> dict[str, Any]:
    """`settings` plus the layout picked for `hw` (printed), unless they already say one; and the
    dtype for `hw` (printed), unless they say one."""
    if not str(settings.get("device", "cuda")).startswith("cuda"):
        hw = hw._replace(gpus=0)  # told to run on the CPU
    out = dict(settings)
    if not LAYOUT_SETTINGS & settings.keys():
        layout, text = pick_layout(hw)
        other = ("--prefill-workers 0 (colocated)" if layout["num_prefill_workers"] else
                 "--prefill-workers 1 --decode-workers 1 (disaggregated)")
        print(f"pdserve: layout for {_hardware_text(hw)}: {text}; any layout flag overrides it, e.g. {other}",
              flush=True)
        out = {**layout, **settings}
    return _with_dtype(out, settings, hw)


def _with_dtype(out: dict[str, Any], given: dict[str, Any], hw: Hardware) -> dict[str, Any]:
    if "dtype" not in given and (dtype := pick_dtype(hw, str(out.get("device", "cpu")))):
        print(f"pdserve: dtype {dtype} (this CPU multiplies bf16 matrices in hardware, {hw.cpu_bf16}); --dtype "
              "float32 computes in full precision, as transformers' own fp32 generate does", flush=True)
        out["dtype"] = dtype
    return out


def _serve(args: argparse.Namespace) -> int:
    from deployments.config import ServeConfig, direct_ingress_env

    launch, settings = split_args(args)
    cfg = ServeConfig.from_dict(settings)  # a bad setting stops here, before Ray starts (cli.main: exit 2)
    if why := grpc_bind_error(cfg.http_host, launch.grpc_port):
        print(f"pdserve: {why}", file=sys.stderr)
        return 2
    if not launch.address and (why := http_port_error(cfg.http_host, cfg.http_port)):
        print(f"pdserve: {why}", file=sys.stderr)
        return 2
    if launch.layout == "single" and (why := ray_reasons(launch, settings)):
        print(f"pdserve: --layout single serves one engine in this process, without Ray; {', '.join(why)} "
              "needs Ray: drop it, or pass --layout ray", file=sys.stderr)
        return 2
    if not launch.address:
        hw = local_hardware()
        if picks_single_process(launch, settings, hw):
            from deployments.local_server import serve_single_process

            serve_single_process(ServeConfig.from_dict(
                with_single_process(settings, hw, picked=launch.layout == "auto")))
            return 0
    if not launch.address:  # a cluster joined: its layout is picked once Ray is up (`_start`)
        settings = with_layout(settings, hw)
        # NOTE: direct ingress unless told otherwise where pdserve starts Ray itself (it can set Ray's
        # variables) and one ingress replica serves: more would share the proxy's port no more.
        if "direct_ingress" not in settings and (cfg.ingress_max_replicas or cfg.ingress_replicas) == 1:
            settings["direct_ingress"] = True
            print("pdserve: direct ingress (the ingress replica serves HTTP itself; --no-direct-ingress: through "
                  "Serve's proxy)", flush=True)
        cfg = ServeConfig.from_dict(settings)
    proxy_port = cfg.http_port
    if cfg.direct_ingress:
        di_env = direct_ingress_env(cfg.http_port, cfg.direct_ingress_ports())
        if launch.address and any(os.environ.get(k) != v for k, v in di_env.items()):
            print("pdserve: --direct-ingress on an existing cluster needs, on every node, the environment "
                  + " ".join(f"{k}={v}" for k, v in di_env.items()), file=sys.stderr)
            return 2
        os.environ.update(di_env)
        proxy_port = _free_port(cfg.http_host)
    _start(launch, cfg, settings, proxy_port)
    _wait_for_stop()
    return 0


def _start(launch: LaunchOptions, cfg: ServeConfig, settings: dict[str, Any], proxy_port: int) -> None:
    """Start (or join) Ray, start Serve, deploy the HTTP (and gRPC) app, and print where it serves."""
    import ray
    from ray import serve

    from deployments.app import build_app, build_grpc_app
    from deployments.config import ServeConfig, apply_ray_env_defaults
    from deployments.frontend.grpc_app import grpc_options

    if launch.address:
        ray.init(address=launch.address)
        cfg = ServeConfig.from_dict(with_layout(settings, cluster_hardware()))
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
    print_ready(url, cfg.served_model_name, time.perf_counter() - t0)
    if launch.grpc_port:
        print(f"  gRPC: pdserve.Generation/Generate on port {launch.grpc_port} of every interface "
              "(metadata application=pdserve-grpc)", flush=True)
    if cfg.direct_ingress:
        print(f"  direct ingress: the ingress replica serves {url}; Serve's proxy is on port {proxy_port}",
              flush=True)


def print_ready(url: str, model_name: str, took_s: float) -> None:
    print(f"pdserve: ready in {took_s:.0f}s at {url}/v1  (model: {model_name})", flush=True)
    print(f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
          f"-d '{{\"model\": \"{model_name}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hi\"}}]}}'",
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
