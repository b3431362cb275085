"""`pdserve serve`: start (or join) Ray, deploy the app, print the URL, serve until Ctrl-C."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time


def add_serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="start the OpenAI-compatible server (Ray + Serve)")
    s.add_argument("--model", default=None, help="HF dir, .gguf file or cached hub id (default: embedded SmolLM2)")
    s.add_argument("--model-name", default=None, help="name clients pass as `model` (default: from the model)")
    s.add_argument("--prefill-workers", type=int, default=1,
                   help="0: colocated, each decode worker prefills its own prompts (no KV transfer)")
    s.add_argument("--decode-workers", type=int, default=1)
    s.add_argument("--threads-per-worker", type=int, default=1)
    s.add_argument("--worker-num-cpus", type=float, default=1.0)
    s.add_argument("--worker-num-gpus", type=float, default=0.0, help="1 on a GPU cluster")
    s.add_argument("--device", default="cpu", help="torch device of the workers (cuda on GPU nodes)")
    s.add_argument("--dtype", default="float32")
    s.add_argument("--kv-cache-dtype", default="auto",
                   help="the KV cache's element type: auto (= --dtype), float32, bfloat16, float16 or fp8_e5m2; "
                        "narrower holds more tokens and decodes faster, rounding K and V")
    s.add_argument("--kv-cache-memory-mb", type=int, default=2048)
    s.add_argument("--max-num-seqs", type=int, default=64)
    s.add_argument("--max-num-batched-tokens", type=int, default=1024)
    s.add_argument("--max-model-len", type=int, default=None)
    s.add_argument("--decode-max-prefill-tokens", type=int, default=128,
                   help="prompt tokens a decode worker computes per step next to a prefill pool")
    s.add_argument("--local-prefill-max-tokens", type=int, default=512,
                   help="prompts up to this long may prefill on a decode worker when the prefill pool is "
                        "backed up (0: never)")
    s.add_argument("--no-prefix-caching", action="store_true",
                   help="engines do not keep the KV of ended requests for later prompts with the same prefix")
    s.add_argument("--no-prefix-aware-routing", action="store_true",
                   help="place prompts by queue length only, not where their prefix is likely cached")
    s.add_argument("--no-kv-backup", action="store_true",
                   help="do not copy prompts that decode workers prefilled themselves to a prefill worker's cache "
                        "(the copy shortens the recompute when a decode worker dies)")
    s.add_argument("--no-kv-prefix-fetch", action="store_true",
                   help="a dead decode worker's sequence moving to another decode worker recomputes its whole "
                        "prompt there instead of pulling the cached part from a prefill worker")
    s.add_argument("--max-queued-requests", type=int, default=256)
    s.add_argument("--cluster-resources", action="store_true",
                   help="pin workers to nodes with the `prefill` / `decode` custom resources (cluster.yaml)")
    s.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY"),
                   help="require `Authorization: Bearer KEY` (default: $PDSERVE_API_KEY)")
    s.add_argument("--host", default="127.0.0.1", help="HTTP bind address (0.0.0.0 to expose it)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--grpc-port", type=int, default=9000, help="gRPC port (0: no gRPC service)")
    s.add_argument("--address", default=None, help="join this Ray cluster (e.g. auto) instead of starting one")
    s.add_argument("--direct-ingress", action="store_true",
                   help="the ingress replica serves HTTP on --port itself (Ray Serve direct ingress), without the "
                        "proxy's relay of every streamed token; Serve's proxy moves to a free port")
    s.add_argument("--ingress-max-replicas", type=int, default=None,
                   help="autoscale the HTTP/gRPC ingress on ongoing requests up to this many replicas")
    s.set_defaults(func=_serve)


def _free_port(host: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _serve(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    from deployments.app import build_app, build_grpc_app, shutdown_router
    from deployments.frontend.grpc_app import grpc_options
    from deployments.config import ServeConfig, apply_ray_env_defaults, direct_ingress_env
    from engine import EngineConfig

    engine = EngineConfig(model=args.model, num_threads=args.threads_per_worker, device=args.device, dtype=args.dtype,
                          kv_cache_dtype=args.kv_cache_dtype, kv_cache_memory_mb=args.kv_cache_memory_mb,
                          max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching)
    cfg = ServeConfig(
        engine=engine, model_name=args.model_name, num_prefill_workers=args.prefill_workers,
        num_decode_workers=args.decode_workers,
        worker_num_cpus=args.worker_num_cpus, worker_num_gpus=args.worker_num_gpus,
        decode_max_prefill_tokens=args.decode_max_prefill_tokens,
        local_prefill_max_tokens=args.local_prefill_max_tokens,
        prefix_aware_routing=not args.no_prefix_aware_routing, kv_backup=not args.no_kv_backup,
        kv_prefix_fetch=not args.no_kv_prefix_fetch,
        max_queued_requests=args.max_queued_requests,
        api_key=args.api_key, http_host=args.host,
        http_port=args.port, direct_ingress=args.direct_ingress, ingress_max_replicas=args.ingress_max_replicas,
        prefill_resources={"prefill": 0.01} if args.cluster_resources else {},
        decode_resources={"decode": 0.01} if args.cluster_resources else {},
    )
    proxy_port = cfg.http_port
    if cfg.direct_ingress:
        di_env = direct_ingress_env(cfg.http_port, cfg.direct_ingress_ports())
        if args.address and any(os.environ.get(k) != v for k, v in di_env.items()):
            print("pdserve: --direct-ingress on an existing cluster needs, on every node, the environment "
                  + " ".join(f"{k}={v}" for k, v in di_env.items()), file=sys.stderr)
            return 2
        os.environ.update(di_env)
        proxy_port = _free_port(cfg.http_host)
    if args.address:
        ray.init(address=args.address)
    else:
        apply_ray_env_defaults()
        needed = int((cfg.num_prefill_workers + cfg.num_decode_workers) * cfg.worker_num_cpus + 0.999)
        ray.init(num_cpus=max(needed, os.cpu_count() or 1), include_dashboard=False)
    serve.start(http_options={"host": cfg.http_host, "port": proxy_port},
                grpc_options=grpc_options(args.grpc_port) if args.grpc_port else None)
    t0 = time.perf_counter()
    pools = (f"{cfg.num_decode_workers} colocated worker(s) (no prefill pool)" if cfg.colocated else
             f"{cfg.num_prefill_workers} prefill + {cfg.num_decode_workers} decode workers")
    print(f"pdserve: starting {pools} for {cfg.served_model_name} ...", flush=True)
    serve.run(build_app(cfg.to_dict()), name="pdserve", route_prefix="/")
    if args.grpc_port:
        serve.run(build_grpc_app(cfg.to_dict()), name="pdserve-grpc", route_prefix="/pdserve-grpc")
    url = f"http://{cfg.http_host}:{cfg.http_port}"
    print(f"pdserve: ready in {time.perf_counter() - t0:.0f}s at {url}/v1  (model: {cfg.served_model_name})", flush=True)
    print(f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
          f"-d '{{\"model\": \"{cfg.served_model_name}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hi\"}}]}}'",
          flush=True)
    if args.grpc_port:
        print(f"  gRPC: pdserve.Generation/Generate on {cfg.http_host}:{args.grpc_port} "
              "(metadata application=pdserve-grpc)", flush=True)
    if cfg.direct_ingress:
        print(f"  direct ingress: the ingress replica serves {url}; Serve's proxy is on port {proxy_port}",
              flush=True)
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
    return 0


if __name__ == "__main__":
    sys.exit(0)
