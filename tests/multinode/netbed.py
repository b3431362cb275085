"""What the multi-node tests share: the bed (scripts/netns_cluster.py: Ray hosts in network namespaces
on this machine), pdserve placed across it, and ways to look at where things run and what crossed a link.

Import it as `netbed` (pytest puts this folder on sys.path)."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parents[2] / "scripts"))  # for netns_cluster only
netns_cluster = importlib.import_module("netns_cluster")
HostSpec = netns_cluster.HostSpec
RAY_NAMESPACE = "pdserve-multinode"  # the Ray namespace the tests join in
NetBed = netns_cluster.NetBed


def bed_unavailable() -> str | None:
    """Why no bed can be built here (None: it can)."""
    if sys.platform != "linux" or os.geteuid() != 0:
        return "needs root on Linux (ip netns, mount, unshare)"
    for tool in ("ip", "unshare", "ss", "mount"):
        if shutil.which(tool) is None:
            return f"needs the {tool} command"
    probe = subprocess.run(["unshare", "--net", "--mount", "--uts", "--time", "true"], capture_output=True,
                           text=True, timeout=10)
    if probe.returncode != 0:
        return f"cannot create namespaces here: {probe.stderr.strip()}"
    return None


def disconnect() -> None:
    """Shut down Serve and pdserve's router (with its workers) if they run, then leave Ray."""
    import ray

    if not ray.is_initialized():
        return
    try:
        from ray import serve

        serve.shutdown()
    except Exception:  # noqa: BLE001 - Serve may never have started
        pass
    try:
        from deployments.app import shutdown_router

        shutdown_router(timeout_s=20)
    finally:
        ray.shutdown()


# ---------------------------------------------------------------------------------------------- looking in
def alive_nodes() -> dict[str, str]:
    """Ray node id -> node IP, for the nodes the GCS counts alive."""
    import ray

    return {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}


def host_of_node(bed: Any, node_id: str) -> str:
    """The bed host a Ray node id runs on."""
    import ray

    ip = next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id)
    return next(h.name for h in bed.hosts.values() if h.ip == ip)


def ray_processes(bed: Any, host: str) -> dict[int, str]:
    """pid -> process title (`ray::Router`, `ray::DecodeWorker`, ...) of host's Ray worker processes."""
    out = {}
    for pid in bed.pids(host):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
        except OSError:
            continue
        if title.startswith("ray::"):
            out[pid] = title
    return out


def pids_titled(bed: Any, host: str, prefix: str) -> list[int]:
    """Host's Ray processes whose title starts with `prefix` (e.g. "ray::DecodeWorker")."""
    return [pid for pid, title in ray_processes(bed, host).items() if title.startswith(prefix)]


def start_pdserve(config: Any, timeout_s: float = 600.0) -> tuple[Any, Any]:
    """pdserve's router where `config.router_resources` place it (as the ingress creates it), once its
    first workers are ready (each host resolves and loads the model itself), and a StreamHub in this
    (the driver's) process, on its node's address, which no test kills: (router, hub) for `stream_all`."""
    import ray

    from deployments.app import get_or_create_router
    from deployments.frontend.stream_hub import StreamHub

    router = get_or_create_router(config)
    ray.get(router.wait_ready.remote(timeout_s), timeout=timeout_s + 100)
    return router, StreamHub()


def deploy_http(bed: Any, config: Any) -> str:
    """The HTTP app as `serve deploy serve_config.yaml` builds it (`build_app`, so the ingress goes
    where `config.ingress_resources` place it), behind Serve's proxy on the head; its /v1 URL."""
    from ray import serve

    from deployments.app import build_app

    serve.start(proxy_location="HeadOnly", http_options={"host": "0.0.0.0", "port": 8000})
    serve.run(build_app(config.to_dict()), name="pdserve", route_prefix="/")
    return f"http://{bed.hosts['head'].ip}:8000/v1"


def on_host(bed: Any, host: str) -> Any:
    """A scheduling strategy that runs a task or actor on bed host `host`, whatever its resources."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node_id = next(nid for nid, ip in alive_nodes().items() if ip == bed.hosts[host].ip)
    return NodeAffinitySchedulingStrategy(node_id, soft=False)


# ---------------------------------------------------------------------------------------------- streams
def stream_all(router: Any, hub: Any, prompts: list[list[int]], params: Any, on_progress: Any = None,
               timeout_s: float = 300.0) -> tuple[list[list[int]], list[float]]:
    """Run `prompts` at once through the router (RouterBackend, as the ingress does), tokens from
    `hub`. `on_progress(progress)` (async) runs beside them and sees each stream's token count so far.
    Returns every stream's tokens and its longest gap between two tokens (seconds)."""
    import asyncio
    import uuid

    from deployments.frontend.router_client import RouterBackend

    backend = RouterBackend(router, hub, f"hub-{uuid.uuid4().hex[:6]}", request_timeout_s=timeout_s)
    progress, gaps = [0] * len(prompts), [0.0] * len(prompts)

    async def one(i: int, ids: list[int]) -> list[int]:
        toks: list[int] = []
        last = None
        async for d in backend.generate(f"m{i}-{uuid.uuid4().hex[:6]}", ids, params):
            assert d.finish_reason != "error", d.error
            now = time.monotonic()
            if last is not None and d.token_ids:
                gaps[i] = max(gaps[i], now - last)
            last = now
            toks += d.token_ids
            progress[i] = len(toks)
        return toks

    async def go() -> list[list[int]]:
        tasks = [asyncio.create_task(one(i, ids)) for i, ids in enumerate(prompts)]
        if on_progress is not None:
            await on_progress(progress)
        return await asyncio.wait_for(asyncio.gather(*tasks), timeout_s)

    return asyncio.run(go()), gaps

