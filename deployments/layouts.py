"""Layouts, named by topology: which processes `pdserve serve` starts for the hardware it finds.

    single     the door and one engine in the `pdserve serve` process; no Ray, no KV transfer
    colocated  Ray: door, router, decode workers that also prefill; no KV transfer
    disagg     Ray: door, router, a prefill pool and a decode pool; KV moves between them
    auto       the fastest of these for the hardware (docs/guides/layouts.md), and it says which

Each layout fills in the pool sizes, threads and devices for the hardware unless a flag says them;
a flag that contradicts the layout named (`--layout colocated --prefill-workers 1`) is refused.
"""

from __future__ import annotations

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


def pool_settings(layout: Layout, hw: Hardware) -> dict[str, Any]:
    """The pools of `layout` on `hw` (a Ray layout).

    - colocated: one worker per GPU, else one per node with a thread per core.
    - disagg: half the GPUs prefill workers and the rest decode workers, one GPU each; one GPU: one
      of each sharing it (KV staged through host memory); CPUs: one of each per node pair, each on
      half a node's cores (they also step on the other's idle cores, `share_node_cores`)."""
    if layout == "colocated":
        if hw.gpus:
            return {"num_prefill_workers": 0, "num_decode_workers": hw.gpus, "worker_num_gpus": 1.0,
                    "worker_num_cpus": 1.0, "device": "cuda"}
        return {"num_prefill_workers": 0, "num_decode_workers": hw.nodes, "num_threads": hw.cpus,
                "worker_num_cpus": float(hw.cpus)}
    assert layout == "disagg", layout
    if hw.gpus >= 2:
        prefill = hw.gpus // 2
        return {"num_prefill_workers": prefill, "num_decode_workers": hw.gpus - prefill, "worker_num_gpus": 1.0,
                "worker_num_cpus": 1.0, "device": "cuda"}
    if hw.gpus == 1:
        return {"num_prefill_workers": 1, "num_decode_workers": 1, "worker_num_gpus": 0.5, "worker_num_cpus": 1.0,
                "device": "cuda"}
    prefill = max(1, hw.nodes // 2)
    threads = max(1, hw.cpus // 2) if hw.nodes == 1 else hw.cpus
    return {"num_prefill_workers": prefill, "num_decode_workers": max(1, hw.nodes - prefill),
            "num_threads": threads, "worker_num_cpus": float(threads)}


def fastest_layout(hw: Hardware, settings: dict[str, Any], needs_ray: bool) -> Layout:
    """What `auto` picks (docs/guides/layouts.md): one process on a small CPU host when nothing asks for
    Ray; else disaggregated with GPUs for each pool, colocated otherwise (a small node's cores are
    lost to whichever pool idles)."""
    on_cpu = hw.gpus == 0 or not str(settings.get("device", "cuda")).startswith("cuda")
    if on_cpu and hw.cpus <= SINGLE_PROCESS_MAX_CPUS and not needs_ray:
        return "single"
    return "disagg" if hw.gpus >= 2 and not on_cpu else "colocated"


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
        print(f"pdserve: auto picked the fastest layout for this hardware ({hw.text()}): {layout}; {other}",
              flush=True)
        out = {**pool_settings(layout, hw), **settings} if layout != "single" else out
    elif layout != "single":
        out = {**pool_settings(layout, hw), **settings}
    if layout == "single":
        out.setdefault("num_threads", hw.cpus)
    if "dtype" not in settings and (dtype := pick_dtype(hw, str(out.get("device", "cpu")))):
        print(f"pdserve: dtype {dtype} (this CPU multiplies bf16 matrices in hardware, {hw.cpu_bf16}); --dtype "
              "float32 computes in full precision, as transformers' own fp32 generate does", flush=True)
        out["dtype"] = dtype
    return layout, out
