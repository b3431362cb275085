"""Layouts, named by topology: which processes `pdserve serve` starts for the hardware it finds.

    single     the door and one engine in the `pdserve serve` process; no Ray, no KV transfer
    colocated  Ray: door, router, decode workers that also prefill; no KV transfer
    disagg     Ray: door, router, a prefill pool and a decode pool; KV moves between them
    auto       the fastest of these for the hardware (docs/guides/layouts.md), and it says which

Each layout fills in the pool sizes, threads and devices for the hardware unless a flag says them;
a flag that contradicts the layout named (`--layout colocated --prefill-workers 1`) is refused.
"""

from __future__ import annotations

import math
import os
from typing import Any, Literal, NamedTuple

Layout = Literal["single", "colocated", "disagg"]
LAYOUTS = ("auto", "single", "colocated", "disagg")
# The most cores on which `auto` picks the single-process layout: there the Ray layouts' own
# processes take a share of the engine's cores that costs it 20-30% (docs/guides/layouts.md).
SINGLE_PROCESS_MAX_CPUS = 4
# The settings that make up a layout: under `auto`, given any of them, the layout is taken as given.
LAYOUT_SETTINGS = frozenset({"num_prefill_workers", "num_decode_workers", "num_threads", "worker_num_cpus",
                             "worker_num_gpus", "prefill_resources", "decode_resources"})
# Server settings (beyond every engine setting) that the single-process layout honours; every other
# one is about Ray's pools, routing, autoscaling or ingress replicas.
SINGLE_PROCESS_SETTINGS = frozenset({"model_name", "max_queued_requests", "request_timeout_s", "api_key",
                                     "http_host", "http_port", "otlp_endpoint", "trace_exporter", "api_keys_file",
                                     "max_request_tokens", "http_limit_concurrency", "http_keepalive_timeout_s",
                                     "http_header_timeout_s", "http_body_timeout_s"})
# /proc/cpuinfo flag -> the name printed; the first found wins. AMX tiles: 4-6x fp32's rate at
# SmolLM2's shapes; AVX512-BF16 dot products (Zen 4, Cooper Lake): 2.0-2.3x (docs/guides/layouts.md).
BF16_FLAGS = (("amx_bf16", "AMX"), ("avx512_bf16", "AVX512-BF16"))


class Hardware(NamedTuple):
    """What `pdserve serve` serves on: CPU cores per node, GPUs in all, nodes, and the CPU's instructions
    that multiply bf16 matrices in hardware ("AMX", "AVX512-BF16"; "" for none)."""

    cpus: int
    gpus: int
    nodes: int = 1
    cpu_bf16: str = ""

    def text(self) -> str:
        gpus = f"{self.gpus} GPU{'s' * (self.gpus != 1)}" if self.gpus else "no GPU"
        node = f"{self.nodes} nodes x {self.cpus}" if self.nodes > 1 else f"{self.cpus}"
        return f"{node} CPU core{'s' * (self.cpus != 1)}, {gpus}"


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


def ray_only_settings(settings: dict) -> list[str]:
    """The settings of `settings` (ServeConfig.from_dict names) that only a Ray layout can honour."""
    from deployments.config import serve_settings

    engine_names = {s.name for s in serve_settings() if s.owner == "engine"}
    return sorted(k for k in settings if k not in engine_names and k not in SINGLE_PROCESS_SETTINGS)


def tp_sizes(settings: dict[str, Any]) -> tuple[int, int]:
    """(prefill_tp, decode_tp) as given (1 each by default; ServeConfig checks them later)."""
    def size(name: str) -> int:
        v = settings.get(name, 1)
        return v if isinstance(v, int) and not isinstance(v, bool) and v >= 1 else 1  # a bad one: ServeConfig's error
    return size("prefill_tp"), size("decode_tp")


def _rank_cpus(cores: int, ranks: int) -> tuple[int, float]:
    """(threads, Ray CPUs) of each of `ranks` ranks sharing `cores`: an equal share, at least a thread.
    NOTE: Ray keeps 4 decimals of a resource: rounded down, `ranks` shares never add up to more than
    the cores (2/3 rounded to 0.6667 three times would not fit 2 CPUs)."""
    if cores >= ranks:
        return cores // ranks, float(cores // ranks)
    return 1, math.floor(cores / ranks * 1e4) / 1e4


def _needs_gpus(layout: Layout, prefill_tp: int, decode_tp: int) -> int:
    """The fewest GPUs `layout` serves on with these TP sizes (one GPU a rank; one GPU: both TP-1 pools share it)."""
    if layout == "colocated":
        return decode_tp
    return 1 if prefill_tp == decode_tp == 1 else prefill_tp + decode_tp


def pool_settings(layout: Layout, hw: Hardware, prefill_tp: int = 1, decode_tp: int = 1) -> dict[str, Any]:
    """The pools of `layout` on `hw` (a Ray layout), for workers of `prefill_tp` / `decode_tp` ranks.

    - colocated: one worker per `decode_tp` GPUs, else one per node, each rank on cores / decode_tp.
    - disagg: about half the GPUs prefill workers (`prefill_tp` GPUs each) and the rest decode workers
      (`decode_tp` each), one GPU a rank; one GPU and TP 1: one of each sharing it (KV staged through
      host memory); CPUs: one of each per node pair, each on half a node's cores (they also step on
      the other's idle cores, `share_node_cores`), that half split between the worker's ranks.
    `worker_num_cpus` and the threads are one setting for every rank of both pools: with TP the
    ranks of one node share its cores equally. A TP size the GPUs cannot hold is refused
    (`ServeConfigError`): Ray would wait for them forever."""
    from deployments.config import ServeConfigError

    if hw.gpus and hw.gpus < _needs_gpus(layout, prefill_tp, decode_tp):
        tp = f"decode_tp={decode_tp}" if layout == "colocated" else f"prefill_tp={prefill_tp} + decode_tp={decode_tp}"
        raise ServeConfigError(f"--layout {layout} with {tp} needs {_needs_gpus(layout, prefill_tp, decode_tp)} "
                               f"GPUs (one a rank), found {hw.gpus}: lower the TP sizes"
                               + (" or pass --layout colocated" if layout == "disagg" else ""))
    if layout == "colocated":
        if hw.gpus:
            return {"num_prefill_workers": 0, "num_decode_workers": hw.gpus // decode_tp, "worker_num_gpus": 1.0,
                    "worker_num_cpus": 1.0, "device": "cuda"}
        threads, cpus = _rank_cpus(hw.cpus, decode_tp)
        return {"num_prefill_workers": 0, "num_decode_workers": hw.nodes, "num_threads": threads,
                "worker_num_cpus": cpus}
    assert layout == "disagg", layout
    if hw.gpus >= 2:
        prefill = max(1, hw.gpus // 2 // prefill_tp)
        decode = max(1, (hw.gpus - prefill * prefill_tp) // decode_tp)
        return {"num_prefill_workers": prefill, "num_decode_workers": decode, "worker_num_gpus": 1.0,
                "worker_num_cpus": 1.0, "device": "cuda"}
    if hw.gpus == 1:
        return {"num_prefill_workers": 1, "num_decode_workers": 1, "worker_num_gpus": 0.5, "worker_num_cpus": 1.0,
                "device": "cuda"}
    prefill = max(1, hw.nodes // 2)
    # one node: a prefill and a decode worker share it, each rank an equal share; else a node each
    threads, cpus = _rank_cpus(hw.cpus, prefill_tp + decode_tp) if hw.nodes == 1 else \
        _rank_cpus(hw.cpus, max(prefill_tp, decode_tp))
    return {"num_prefill_workers": prefill, "num_decode_workers": max(1, hw.nodes - prefill),
            "num_threads": threads, "worker_num_cpus": cpus}


def tp_note(layout: Layout, hw: Hardware, pools: dict[str, Any], prefill_tp: int, decode_tp: int) -> str:
    """Why the pools are what they are with TP (empty without): auto's printed line carries it."""
    if max(prefill_tp, decode_tp) == 1 or layout == "single":
        return ""
    tps = [(decode_tp, pools["num_decode_workers"], "decode")]
    if layout == "disagg":
        tps.insert(0, (prefill_tp, pools["num_prefill_workers"], "prefill"))
    workers = " + ".join(f"{n} {role} worker{'s' * (n != 1)} of {tp} rank{'s' * (tp != 1)}" for tp, n, role in tps)
    if hw.gpus:
        why = "one GPU a rank"
        if layout == "colocated" and hw.gpus >= 2:
            why += f"; disagg needs prefill_tp + decode_tp = {prefill_tp + decode_tp} GPUs"
    else:
        share = pools["worker_num_cpus"]
        why = f"each rank {share:g} CPU{'s' * (share != 1)} and {pools['num_threads']} thread" \
              f"{'s' * (pools['num_threads'] != 1)} (a worker's ranks share one node's cores)"
    return f" ({workers}: {why})"


def fastest_layout(hw: Hardware, settings: dict[str, Any], needs_ray: bool) -> Layout:
    """What `auto` picks (docs/guides/layouts.md): one process on a small CPU host when nothing asks for
    Ray; else disaggregated with GPUs for each pool, colocated otherwise (a small node's cores are
    lost to whichever pool idles). With TP, "GPUs for each pool" means a whole worker of each: one GPU
    a rank, prefill_tp + decode_tp of them."""
    on_cpu = hw.gpus == 0 or not str(settings.get("device", "cuda")).startswith("cuda")
    if on_cpu and hw.cpus <= SINGLE_PROCESS_MAX_CPUS and not needs_ray:
        return "single"
    return "disagg" if not on_cpu and hw.gpus >= max(2, sum(tp_sizes(settings))) else "colocated"


def given_layout(settings: dict[str, Any]) -> Layout:
    """The Ray layout that layout flags given under `auto` describe (ServeConfig's default: a prefill pool)."""
    return "colocated" if settings.get("num_prefill_workers", 1) == 0 else "disagg"


def conflict(layout: str, settings: dict[str, Any]) -> str | None:
    """Why `settings` contradict `--layout layout` (None: they do not)."""
    n = settings.get("num_prefill_workers")
    if layout == "colocated" and n:
        return f"--layout colocated has no prefill pool, but --num-prefill-workers is {n}: drop one of them"
    if layout == "disagg" and n == 0:
        return "--layout disagg needs a prefill pool, but --num-prefill-workers is 0: drop one of them"
    return None


def pick_dtype(hw: Hardware, device: str) -> str | None:
    """The dtype `pdserve serve` picks when none is given: bfloat16 on a CPU that multiplies bf16
    matrices in hardware (AMX, AVX512-BF16), 2-6x faster than fp32 ones (docs/guides/layouts.md);
    else None, the engine's `auto` (bfloat16 on CUDA, float32 on other CPUs, which emulate bf16)."""
    return "bfloat16" if not device.startswith("cuda") and hw.cpu_bf16 else None


def resolve(layout: str, settings: dict[str, Any], hw: Hardware, needs_ray: bool = False
            ) -> tuple[Layout, dict[str, Any]]:
    """The layout `--layout layout` serves on `hw`, and `settings` completed for it: the pools for `hw`
    under each flag given, and the dtype unless given. Under `auto`, layout flags other than the
    threads are taken as given (ServeConfig's defaults for the rest), and otherwise it prints what it
    picked. `ray` (deprecated) is `auto` without the single-process layout."""
    if not str(settings.get("device", "cuda")).startswith("cuda"):
        hw = hw._replace(gpus=0)  # told to run on the CPU
    out = dict(settings)
    if layout in ("auto", "ray") and (LAYOUT_SETTINGS - {"num_threads"}) & settings.keys():
        layout = given_layout(settings)
    elif layout in ("auto", "ray"):
        layout = fastest_layout(hw, settings, needs_ray or layout == "ray")
        other = "--layout colocated serves without a prefill pool" if layout == "disagg" else \
            "--layout disagg runs the prefill and decode pools"
        pools = pool_settings(layout, hw, *tp_sizes(settings)) if layout != "single" else {}
        print(f"pdserve: auto picked the fastest layout for this hardware ({hw.text()}): {layout}"
              f"{tp_note(layout, hw, pools, *tp_sizes(settings))}; {other}", flush=True)
        out = {**pools, **settings}
    elif layout != "single":
        out = {**pool_settings(layout, hw, *tp_sizes(settings)), **settings}
    if layout == "single":
        out.setdefault("num_threads", hw.cpus)
    if "dtype" not in settings and (dtype := pick_dtype(hw, str(out.get("device", "cpu")))):
        print(f"pdserve: dtype {dtype} (this CPU multiplies bf16 matrices in hardware, {hw.cpu_bf16}); --dtype "
              "float32 computes in full precision, as transformers' own fp32 generate does", flush=True)
        out["dtype"] = dtype
    return layout, out
