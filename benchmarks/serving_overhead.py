"""Serving-layer overhead: the same workload through HTTP against (a) the engine alone in one process,
(b) Ray Serve colocated (one decode worker that prefills too) and (c) Ray Serve with 1 prefill + 1 decode
actor, all at equal total threads (2).

```
 (a) engine:     loadgen ──HTTP──▶ uvicorn (this process) ──▶ LocalEngineBackend ──▶ LLMEngine (2 threads)
 (b) colocated:  loadgen ──HTTP──▶ Serve proxy ──▶ ingress ──▶ router ──▶ decode worker (2 threads)
 (c) disagg:     loadgen ──HTTP──▶ Serve proxy ──▶ ingress ──▶ router ──▶ prefill (1 thread) ══KV══▶ decode (1 thread)
```

(b) and (c) run twice (`--ingress both`, the default): through Serve's proxy, and with direct ingress,
where the ingress replica serves HTTP itself and the proxy hop (a relay of every streamed token between
two processes) is gone.

All go through the same load generator (`pdserve bench`'s `run_benchmark`), so the HTTP/SSE/tokenizer
cost of the ingress is in every row. (b) adds what the serving layer itself costs: Ray Serve's proxy, the
router, actor calls, token streaming between processes. (c) adds the KV handoff over gloo and, on one
2-core machine, the split of the cores into a fixed 1 + 1 (on a cluster each pool has its own GPUs).
(c) runs as the server does by default, with conditional disaggregation (a short prompt prefills on the
decode worker when that starts it sooner than the prefill worker's queue), and once more as pure
disaggregation (`local_prefill_max_tokens=0`: every prompt through the prefill worker and KV transfer).
Per-token overhead = 1/tput(x) - 1/tput(a).

    .venv/bin/python benchmarks/serving_overhead.py [--num-prompts 32 --request-rate 8 --result-json PATH]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import MODEL_NAME, bench_url, engine_http_server, fmt, router_counters, serve_app  # noqa: E402
from deployments.bench_cli import BenchConfig  # noqa: E402
from engine import EngineConfig  # noqa: E402


def run_engine_alone(cfg: BenchConfig, warmup: int) -> dict:
    with engine_http_server(EngineConfig(model=None, num_threads=2)) as url:
        return bench_url(cfg, url, warmup)


def run_ray_serve(cfg: BenchConfig, warmup: int, prefill: int, threads: int, direct: bool = False,
                  local_prefill_max_tokens: int = 512, **settings) -> dict:
    """`settings`: more ServeConfig fields (e.g. decode_max_prefill_tokens, kv_backup)."""
    app_args = {"num_prefill_workers": prefill, "num_decode_workers": 1, "threads_per_worker": threads,
                "worker_num_cpus": 1 if prefill else 2, "local_prefill_max_tokens": local_prefill_max_tokens,
                **settings}
    with serve_app(app_args, num_cpus=2, direct=direct) as url:
        result = bench_url(cfg, url, warmup)
        result["router_counters"] = router_counters()
        return result


def _row(name: str, m: dict) -> list[str]:
    return [name, f"{m['completed']}/{m['num_requests']}", fmt(m["output_throughput"]), fmt(m["ttft_ms"]["p50"]),
            fmt(m["ttft_ms"]["p99"]), fmt(m["tpot_ms"]["p50"]), fmt(m["tpot_ms"]["p99"]), fmt(m["e2e_ms"]["p50"]),
            fmt(m["duration_s"], 2)]


def report(results: dict, threads: int = 1, other_cap: int | None = None) -> dict:
    from rich.console import Console
    from rich.table import Table

    disagg = f"Ray Serve disaggregated (1P+1D, {threads} thread{'s' if threads > 1 else ''} each)"
    names = {"engine": "engine alone, HTTP in-process (2 threads)",
             "colocated": "Ray Serve colocated (1 worker, 2 threads), proxy",
             "colocated-direct": "Ray Serve colocated (1 worker, 2 threads), direct ingress",
             "disaggregated": f"{disagg}, proxy",
             "disaggregated-direct": f"{disagg}, direct ingress",
             "disaggregated-pure": f"{disagg}, no local prefill, proxy",
             "disaggregated-pure-direct": f"{disagg}, no local prefill, direct ingress",
             "disaggregated-cap": f"{disagg}, decode prefill cap {other_cap}, proxy",
             "disaggregated-cap-direct": f"{disagg}, decode prefill cap {other_cap}, direct ingress",
             "disaggregated-nobackup": f"{disagg}, no KV backup, proxy",
             "disaggregated-nobackup-direct": f"{disagg}, no KV backup, direct ingress"}
    cols = ["setup", "ok", "out tok/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms", "E2E p50 ms",
            "duration s"]
    table = Table(title="serving overhead (same workload, same 2 cores)", title_justify="left")
    for i, c in enumerate(cols):
        table.add_column(c, justify="left" if i == 0 else "right")
    for key, name in names.items():
        if key in results:
            table.add_row(*_row(name, results[key]["metrics"]))

    def ratio(x, y):
        return None if not x or y is None else y / x

    g = lambda x: "-" if x is None else f"{x:.2f}x"  # noqa: E731
    a = results["engine"]["metrics"]
    summary = {}
    for key in names:
        if key == "engine" or key not in results:
            continue
        b = results[key]["metrics"]
        ratios = {"output_throughput": ratio(a["output_throughput"], b["output_throughput"]),
                  **{f"{k}_{p}": ratio(a[k][p], b[k][p]) for k in ("ttft_ms", "tpot_ms") for p in ("p50", "p99")},
                  "e2e_ms_p50": ratio(a["e2e_ms"]["p50"], b["e2e_ms"]["p50"])}
        table.add_row(f"ratio {key} / engine", "", g(ratios["output_throughput"]), g(ratios["ttft_ms_p50"]),
                      g(ratios["ttft_ms_p99"]), g(ratios["tpot_ms_p50"]), g(ratios["tpot_ms_p99"]),
                      g(ratios["e2e_ms_p50"]), "")
        summary[key] = {"ratios": ratios}
        if a["output_throughput"] and b["output_throughput"]:
            loss = 1.0 - b["output_throughput"] / a["output_throughput"]
            per_tok_ms = 1000.0 / b["output_throughput"] - 1000.0 / a["output_throughput"]
            summary[key].update(throughput_loss=loss, overhead_ms_per_token=per_tok_ms, meets_target=loss <= 0.10)
    console = Console(width=170)
    console.print(table)
    for key, s in summary.items():
        if "throughput_loss" in s:
            verdict = "[green]meets[/green]" if s["meets_target"] else "[red]misses[/red]"
            counters = results[key].get("router_counters") or {}
            local = f"; {counters['local_prefills']} prompts prefilled on the decode worker" \
                if counters.get("local_prefills") else ""
            console.print(f"{key}: throughput loss {s['throughput_loss']:+.1%} ({verdict} the <= 10% target); "
                          f"{s['overhead_ms_per_token']:+.2f} ms per output token over the engine alone{local}")
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
    p.add_argument("--only", choices=("engine", "colocated", "disaggregated"), default=None)
    p.add_argument("--ingress", choices=("proxy", "direct", "both"), default="both",
                   help="how HTTP reaches the Ray Serve ingress: through Serve's proxy, or served by the ingress "
                        "replica itself (direct ingress, `pdserve serve --direct-ingress`)")
    p.add_argument("--disagg-threads", type=int, default=1,
                   help="torch threads per worker in the disaggregated run (1: equal total threads; 2: each "
                        "worker may use both cores when the other idles, oversubscribed otherwise)")
    p.add_argument("--local-prefill-max-tokens", type=int, default=512,
                   help="the disaggregated rows' conditional disaggregation (the server's default); a pure "
                        "disaggregation row (0: every prompt through the prefill worker) runs too unless this is 0 "
                        "or --no-pure")
    p.add_argument("--no-pure", action="store_true", help="skip the pure disaggregation row")
    p.add_argument("--no-backup-row", action="store_true",
                   help="one more disaggregated row with kv_backup off (what copying local prefills costs)")
    p.add_argument("--other-decode-cap", type=int, default=None, metavar="N",
                   help="also run the disaggregated row with the decode worker's prompt tokens per step capped at "
                        "N (`decode_max_prefill_tokens`; the server's default runs in the main row)")
    p.add_argument("--repeats", type=int, default=1,
                   help="run every row this many times, interleaved (engine, colocated, disaggregated, engine, "
                        "...); each repeat's rows are compared with that repeat's engine row, and the median "
                        "of those ratios is the verdict (these 2 cores vary by ~10%% between runs)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.repeats > 1:
        return _repeated(args)
    results = _run_rows(args)
    if "engine" in results and len(results) > 1:
        results["summary"] = report(results, args.disagg_threads, args.other_decode_cap)
    else:
        from deployments.bench_cli import print_report

        for name, r in results.items():
            print_report(r, title=name)
    _save(args, results)
    return 0


def _save(args: argparse.Namespace, results) -> None:
    if args.result_json:
        import json

        Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.result_json).write_text(json.dumps(results, indent=2, default=str) + "\n")


def _repeated(args: argparse.Namespace) -> int:
    """`--repeats N`: N interleaved passes over the rows, then the median loss of each row."""
    import statistics

    from rich.console import Console

    if args.only is not None:
        raise SystemExit("--repeats needs every row (no --only): each repeat compares with its own engine row")
    passes = []
    for i in range(args.repeats):
        print(f"=== repeat {i + 1}/{args.repeats}", flush=True)
        results = _run_rows(args)
        results["summary"] = report(results, args.disagg_threads, args.other_decode_cap)
        passes.append(results)
    console = Console(width=170)
    console.print(f"[bold]median over {args.repeats} interleaved repeats[/bold] (each against its own engine row)")
    for key in passes[0]["summary"]:
        losses = [r["summary"][key].get("throughput_loss") for r in passes]
        losses = [x for x in losses if x is not None]
        if not losses:
            continue
        tput = [r[key]["metrics"]["output_throughput"] for r in passes]
        med = statistics.median(losses)
        verdict = "[green]meets[/green]" if med <= 0.10 else "[red]misses[/red]"
        console.print(f"{key}: median throughput loss {med:+.1%} ({verdict} the <= 10% target); per repeat "
                      + ", ".join(f"{x:+.1%}" for x in losses) + "; tok/s " + ", ".join(f"{x:.1f}" for x in tput)
                      + "; engine tok/s " + ", ".join(f"{r['engine']['metrics']['output_throughput']:.1f}"
                                                     for r in passes))
    _save(args, {"repeats": passes})
    return 0


def _run_rows(args: argparse.Namespace) -> dict:
    cfg = BenchConfig(base_url="http://127.0.0.1", model=MODEL_NAME, num_prompts=args.num_prompts,
                      request_rate=args.request_rate, max_concurrency=args.max_concurrency,
                      input_len_range=tuple(args.input_len_range), output_len_range=tuple(args.output_len_range),
                      vocab_size=args.vocab_size, seed=args.seed, timeout_s=args.timeout_s)
    results = {}
    if args.only in (None, "engine"):
        results["engine"] = run_engine_alone(cfg, args.warmup)
    modes = {"proxy": [False], "direct": [True], "both": [False, True]}[args.ingress]
    for direct in modes:
        if args.only in (None, "colocated"):
            results["colocated" + "-direct" * direct] = run_ray_serve(cfg, args.warmup, prefill=0, threads=2,
                                                                      direct=direct)
    if args.only not in (None, "disaggregated"):
        return results

    def disaggregated(key: str, direct: bool, **app) -> None:
        app.setdefault("local_prefill_max_tokens", args.local_prefill_max_tokens)
        results[key + "-direct" * direct] = run_ray_serve(cfg, args.warmup, prefill=1, threads=args.disagg_threads,
                                                          direct=direct, **app)

    for direct in modes:
        disaggregated("disaggregated", direct)
    # The variants run with the last ingress mode only.
    if args.other_decode_cap is not None:
        disaggregated("disaggregated-cap", modes[-1], decode_max_prefill_tokens=args.other_decode_cap)
    if args.no_backup_row:
        disaggregated("disaggregated-nobackup", modes[-1], kv_backup=False)
    if args.local_prefill_max_tokens and not args.no_pure:
        disaggregated("disaggregated-pure", modes[-1], local_prefill_max_tokens=0)
    return results


if __name__ == "__main__":
    sys.exit(main())
