"""Prefix caching and cache-aware routing under a shared-prefix load, one run, same cores.

The load: prompts that each start with one of `--prefix-groups` random `--prefix-len`-token prefixes
(system prompts, few-shot examples, earlier chat turns) and go on with their own tokens. The server:
2 prefill workers + 1 decode worker (1 thread each) with `--kv-cache-memory-mb` each, small enough
that one worker's cache cannot hold every prefix, but the two together can. Three rows, the same
load each time on a fresh app:

  - caching off:           every prompt computed whole (the baseline);
  - caching, queue routing: each engine caches, the router places prompts by queue length only, so
                            every worker sees every prefix and their caches evict each other's;
  - caching, cache-aware:  the router sends a prompt where its prefix is cached unless that worker's
                            queue costs more than the cache saves (the server's default).

Printed: output tok/s, TTFT and TPOT p50/p99, and the share of prompt tokens the server reported
cached (`usage.prompt_tokens_details.cached_tokens`), with ratios against the baseline.

    .venv/bin/python benchmarks/prefix_routing.py [--num-prompts 64 --request-rate 4 --result-json PATH]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import MODEL_NAME, bench_url, fmt, router_counters, serve_app  # noqa: E402
from deployments.bench_cli import BenchConfig  # noqa: E402

ROWS = {"off": ("caching off", {"enable_prefix_caching": False}),
        "queue": ("caching, queue-length routing", {"prefix_aware_routing": False}),
        "aware": ("caching, cache-aware routing", {})}


def run_row(cfg: BenchConfig, warmup: int, kv_mb: int, settings: dict) -> dict:
    app_args = {"num_prefill_workers": 2, "num_decode_workers": 1, "threads_per_worker": 1,
                "kv_cache_memory_mb": kv_mb, **settings}
    with serve_app(app_args, num_cpus=3) as url:
        result = bench_url(cfg, url, warmup)
        result["router_counters"] = router_counters()
        return result


def report(results: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    cols = ["setup", "ok", "out tok/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms",
            "prompt tok cached", "local prefills", "duration s"]
    table = Table(title="shared-prefix load, 2 prefill + 1 decode workers (1 thread each), same cores",
                  title_justify="left")
    for i, c in enumerate(cols):
        table.add_column(c, justify="left" if i == 0 else "right")
    for key, (name, _) in ROWS.items():
        if key not in results:
            continue
        m, c = results[key]["metrics"], results[key].get("router_counters", {})
        share = m["cached_prompt_tokens"] / m["total_prompt_tokens"] if m["total_prompt_tokens"] else 0.0
        table.add_row(name, f"{m['completed']}/{m['num_requests']}", fmt(m["output_throughput"]),
                      fmt(m["ttft_ms"]["p50"]), fmt(m["ttft_ms"]["p99"]), fmt(m["tpot_ms"]["p50"]),
                      fmt(m["tpot_ms"]["p99"]), f"{share:.0%}", str(c.get("local_prefills", "-")),
                      fmt(m["duration_s"], 2))
    if "off" in results:
        base = results["off"]["metrics"]
        for key, (name, _) in ROWS.items():
            if key == "off" or key not in results:
                continue
            m = results[key]["metrics"]
            r = lambda a, b: "-" if not a or b is None else f"{b / a:.2f}x"  # noqa: E731
            table.add_row(f"ratio {key} / off", "", r(base["output_throughput"], m["output_throughput"]),
                          r(base["ttft_ms"]["p50"], m["ttft_ms"]["p50"]), r(base["ttft_ms"]["p99"], m["ttft_ms"]["p99"]),
                          r(base["tpot_ms"]["p50"], m["tpot_ms"]["p50"]), r(base["tpot_ms"]["p99"], m["tpot_ms"]["p99"]),
                          "", "", "")
    Console(width=170).print(table)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=4.0, help="Poisson req/s")
    p.add_argument("--prefix-groups", type=int, default=16)
    p.add_argument("--prefix-len", type=int, default=448)
    p.add_argument("--input-len-range", type=int, nargs=2, default=(16, 64), metavar=("LO", "HI"),
                   help="each prompt's own tokens after its shared prefix")
    p.add_argument("--output-len-range", type=int, nargs=2, default=(16, 32), metavar=("LO", "HI"))
    p.add_argument("--kv-cache-memory-mb", type=int, default=256,
                   help="per worker (SmolLM2 fp32: 46 KB a token, so 256 MB hold ~5.7k tokens)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--only", choices=tuple(ROWS), nargs="*", default=None)
    p.add_argument("--result-json", default=None)
    args = p.parse_args(argv)
    cfg = BenchConfig(base_url="http://127.0.0.1", model=MODEL_NAME, num_prompts=args.num_prompts,
                      request_rate=args.request_rate, input_len_range=tuple(args.input_len_range),
                      output_len_range=tuple(args.output_len_range), vocab_size=49152, seed=args.seed,
                      timeout_s=args.timeout_s, prefix_groups=args.prefix_groups, prefix_len=args.prefix_len)
    results = {}
    for key, (name, settings) in ROWS.items():
        if args.only is None or key in args.only:
            results[key] = run_row(cfg, args.warmup, args.kv_cache_memory_mb, settings)
    report(results)
    if args.result_json:
        import json

        Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.result_json).write_text(json.dumps(results, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
