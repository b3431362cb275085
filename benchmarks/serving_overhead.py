"""Serving-layer overhead: the same workload through HTTP against (a) the engine colocated in one process and
(b) Ray Serve with 1 prefill + 1 decode actor, at equal total threads (2).

```
 (a) colocated:  loadgen ──HTTP──▶ uvicorn (this process) ──▶ LocalEngineBackend ──▶ LLMEngine (2 threads)
 (b) disagg:     loadgen ──HTTP──▶ Serve proxy ──▶ ingress ──▶ router ──▶ prefill (1 thread) ══KV══▶ decode (1 thread)
```

Both go through the same load generator (`pdserve bench`'s `run_benchmark`), so the HTTP/SSE/tokenizer
cost of the ingress is in both rows; (b) adds Ray Serve's proxy, the router, the KV handoff over gloo and
the Ray processes competing for the same two cores. Per-token overhead = 1/tput(b) - 1/tput(a).

    .venv/bin/python benchmarks/serving_overhead.py [--num-prompts 32 --request-rate 8 --result-json PATH]
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deployments.bench_cli import BenchConfig, run_benchmark  # noqa: E402

MODEL_NAME = "SmolLM2-135M-Instruct"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bench(cfg: BenchConfig, url: str, warmup: int) -> dict:
    """Warm up (compile paths, caches, KV channels), then the measured run on the same URL."""
    if warmup:
        run_benchmark(BenchConfig(base_url=url, model=cfg.model, num_prompts=warmup, input_len=32, output_len=8,
                                  vocab_size=cfg.vocab_size, seed=cfg.seed + 99, progress=False, timeout_s=300))
    return run_benchmark(replace(cfg, base_url=url))


def run_colocated(cfg: BenchConfig, warmup: int) -> dict:
    import uvicorn

    from deployments.backend import LocalEngineBackend
    from deployments.ingress import build_openai_app
    from engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=None, num_threads=2))
    backend = LocalEngineBackend(engine)
    port = _free_port()
    app = build_openai_app(backend, engine.tokenizer, MODEL_NAME, engine.max_model_len)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("the colocated uvicorn server did not start in 30 s")
        time.sleep(0.05)
    try:
        return _bench(cfg, f"http://127.0.0.1:{port}", warmup)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        backend.shutdown()
        del engine, backend, app
        gc.collect()


def run_disaggregated(cfg: BenchConfig, warmup: int, threads: int = 1) -> dict:
    import ray
    from ray import serve

    from deployments.app import build_app, shutdown_router

    port = _free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        t0 = time.perf_counter()
        serve.run(build_app({"num_prefill_workers": 1, "num_decode_workers": 1, "threads_per_worker": threads}),
                  name="pdserve", route_prefix="/")
        print(f"disaggregated app ready in {time.perf_counter() - t0:.1f}s", flush=True)
        return _bench(cfg, f"http://127.0.0.1:{port}", warmup)
    finally:
        try:
            serve.shutdown()
        finally:
            shutdown_router()
            ray.shutdown()


def _row(name: str, m: dict) -> list[str]:
    f = lambda x, d=1: "-" if x is None else f"{x:,.{d}f}"  # noqa: E731
    return [name, f"{m['completed']}/{m['num_requests']}", f(m["output_throughput"]), f(m["ttft_ms"]["p50"]),
            f(m["ttft_ms"]["p99"]), f(m["tpot_ms"]["p50"]), f(m["tpot_ms"]["p99"]), f(m["e2e_ms"]["p50"]),
            f(m["duration_s"], 2)]


def report(coloc: dict, disagg: dict, threads: int = 1) -> dict:
    from rich.console import Console
    from rich.table import Table

    a, b = coloc["metrics"], disagg["metrics"]
    cols = ["setup", "ok", "out tok/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms", "E2E p50 ms",
            "duration s"]
    table = Table(title="serving overhead (same workload, same 2 cores)", title_justify="left")
    for i, c in enumerate(cols):
        table.add_column(c, justify="left" if i == 0 else "right")
    table.add_row(*_row("colocated HTTP (1 engine, 2 threads)", a))
    table.add_row(*_row(f"disaggregated Ray Serve (1P+1D, {threads} thread{'s' if threads > 1 else ''} each)", b))

    def ratio(x, y):
        return None if not x or y is None else y / x

    ratios = {"output_throughput": ratio(a["output_throughput"], b["output_throughput"]),
              **{f"{k}_{p}": ratio(a[k][p], b[k][p]) for k in ("ttft_ms", "tpot_ms") for p in ("p50", "p99")},
              "e2e_ms_p50": ratio(a["e2e_ms"]["p50"], b["e2e_ms"]["p50"])}
    g = lambda x: "-" if x is None else f"{x:.2f}x"  # noqa: E731
    table.add_row("ratio disagg / colocated", "", g(ratios["output_throughput"]), g(ratios["ttft_ms_p50"]),
                  g(ratios["ttft_ms_p99"]), g(ratios["tpot_ms_p50"]), g(ratios["tpot_ms_p99"]),
                  g(ratios["e2e_ms_p50"]), "")
    console = Console(width=160)
    console.print(table)
    summary = {"ratios": ratios}
    if a["output_throughput"] and b["output_throughput"]:
        loss = 1.0 - b["output_throughput"] / a["output_throughput"]
        per_tok_ms = 1000.0 / b["output_throughput"] - 1000.0 / a["output_throughput"]
        summary.update(throughput_loss=loss, overhead_ms_per_token=per_tok_ms, meets_target=loss <= 0.10)
        verdict = "[green]meets[/green]" if loss <= 0.10 else "[red]misses[/red]"
        console.print(f"throughput loss {loss:+.1%} ({verdict} the <= 10% target); serving overhead "
                      f"{per_tok_ms:+.2f} ms per output token (1/tput_disagg - 1/tput_colocated)")
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len-range", type=int, nargs=2, default=(64, 256), metavar=("LO", "HI"))
    p.add_argument("--output-len-range", type=int, nargs=2, default=(32, 128), metavar=("LO", "HI"))
    p.add_argument("--request-rate", type=float, default=8.0, help="Poisson req/s (inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--vocab-size", type=int, default=49152, help="SmolLM2's vocabulary")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=240.0, help="bound on each measured run")
    p.add_argument("--warmup", type=int, default=2, help="short requests before each measured run")
    p.add_argument("--result-json", default=None)
    p.add_argument("--only", choices=("colocated", "disaggregated"), default=None)
    p.add_argument("--disagg-threads", type=int, default=1,
                   help="torch threads per worker in the disaggregated run (1: equal total threads; 2: each "
                        "worker may use both cores when the other idles, oversubscribed otherwise)")
    args = p.parse_args(argv)
    cfg = BenchConfig(base_url="http://127.0.0.1", model=MODEL_NAME, num_prompts=args.num_prompts,
                      request_rate=args.request_rate, max_concurrency=args.max_concurrency,
                      input_len_range=tuple(args.input_len_range), output_len_range=tuple(args.output_len_range),
                      vocab_size=args.vocab_size, seed=args.seed, timeout_s=args.timeout_s)
    results = {}
    if args.only in (None, "colocated"):
        results["colocated"] = run_colocated(cfg, args.warmup)
    if args.only in (None, "disaggregated"):
        results["disaggregated"] = run_disaggregated(cfg, args.warmup, args.disagg_threads)
    if len(results) == 2:
        results["summary"] = report(results["colocated"], results["disaggregated"], args.disagg_threads)
    else:
        from deployments.bench_cli import print_report

        for name, r in results.items():
            print_report(r, title=name)
    if args.result_json:
        import json

        Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.result_json).write_text(json.dumps(results, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
