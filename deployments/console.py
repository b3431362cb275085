"""What `pdserve serve` prints: the process map of the layout it started, and where it serves."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deployments.config import ServeConfig


def _count(start: int, most: int | None) -> str:
    return f"{start}..{most}" if most is not None and most > start else str(start)


def kv_transport(cfg: ServeConfig) -> str:
    """The transport a prefill/decode pair of `cfg` talks (kv_transfer/factory.py picks it per pair):
    NCCL between GPUs, gloo staged through host memory for a pair on one GPU, gloo on CPUs."""
    if not cfg.engine.device.startswith("cuda"):
        return "gloo"
    return "nccl" if cfg.worker_num_gpus >= 1 else "gloo-staged"


def _tp(cfg: ServeConfig, role: str) -> str:
    """", tp N" for a pool of N-rank workers (each a placement group of N actors), else nothing."""
    n = cfg.tp_size(role)
    return f", tp {n}" if n > 1 else ""


def process_map(layout: str, cfg: ServeConfig) -> str:
    """One line: the processes of `layout` under `cfg`, its pools and its KV transport, e.g.
    `pdserve: layout=disagg  ingress(1) -> router(1) -> prefill(1, cpu) =gloo=> decode(1, cpu)`."""
    device = cfg.engine.device
    threads = cfg.engine.num_threads or 1
    if layout == "single":
        return (f"pdserve: layout=single  http+engine(1 process, {threads} thread{'s' * (threads > 1)}, {device}), "
                "no Ray, no KV transfer")
    ingress = f"ingress({_count(cfg.ingress_replicas, cfg.ingress_max_replicas)}) -> router(1)"
    decode = f"decode({_count(cfg.num_decode_workers, cfg.pool_bounds('decode')[1])}, {device}{_tp(cfg, 'decode')}"
    if cfg.colocated:
        return f"pdserve: layout=colocated  {ingress} -> {decode}, prefills too), no KV transfer"
    prefill = f"prefill({_count(cfg.num_prefill_workers, cfg.pool_bounds('prefill')[1])}, {device}{_tp(cfg, 'prefill')})"
    return f"pdserve: layout=disagg  {ingress} -> {prefill} ={kv_transport(cfg)}=> {decode})"


def print_ready(url: str, model_name: str, took_s: float) -> None:
    print(f"pdserve: ready in {took_s:.0f}s at {url}/v1  (model: {model_name})", flush=True)
    print(f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
          f"-d '{{\"model\": \"{model_name}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hi\"}}]}}'",
          flush=True)
