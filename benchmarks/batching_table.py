"""The batching table: one workload, one Poisson arrival rate that saturates the machine, the same
two cores, in one run:

  static      colocated engine, fixed batches of B, each run until its longest request ends
  dynamic     colocated engine, request-level batches (start when full or after max_wait), run to completion
  continuous  colocated engine, token-level batching (requests join and leave every step)
  disagg      Ray Serve, 1 prefill + 1 decode actor (1 thread each), router doing token-level admission

All four go through the same HTTP load generator (`pdserve bench`'s `run_benchmark`); the colocated
rows serve `LLMEngine` (2 threads) behind the same OpenAI ingress in this process.

    .venv/bin/python benchmarks/batching_table.py [--num-prompts 48 --request-rate 4 --batch-size 16]
        [--markdown benchmarks/results/batching_table.md --plot benchmarks/results/batching_table.png]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import MODEL_NAME, bench_url, engine_http_server, fmt, serve_app  # noqa: E402
from deployments.bench_cli import BenchConfig  # noqa: E402
from engine import EngineConfig  # noqa: E402

MODES = ("static", "dynamic", "continuous", "disagg")


def run_colocated(policy: str, cfg: BenchConfig, batch_size: int, max_wait_s: float, warmup: int) -> dict:
    config = EngineConfig(model=None, num_threads=2, batching=policy, max_num_seqs=batch_size, max_wait_s=max_wait_s)
    with engine_http_server(config) as url:
        # NOTE: static batching only starts a batch when B requests wait: warm up with exactly B.
        return bench_url(cfg, url, batch_size if policy == "static" else warmup)


def run_disagg(cfg: BenchConfig, batch_size: int, warmup: int) -> dict:
    app_args = {"num_prefill_workers": 1, "num_decode_workers": 1, "threads_per_worker": 1, "max_num_seqs": batch_size}
    with serve_app(app_args, num_cpus=2) as url:
        return bench_url(cfg, url, warmup)


def render(results: dict, cfg: BenchConfig, batch_size: int, command: str) -> str:
    lines = [
        f"Workload: {cfg.num_prompts} requests, prompts {cfg.input_len_range[0]}-{cfg.input_len_range[1]} random "
        f"tokens, outputs {cfg.output_len_range[0]}-{cfg.output_len_range[1]} tokens (ignore_eos), Poisson "
        f"{cfg.request_rate} req/s, seed {cfg.seed}; batch size / max_num_seqs {batch_size}; goodput SLO: "
        f"TTFT <= {cfg.slo_ttft_ms:.0f} ms and TPOT <= {cfg.slo_tpot_ms:.0f} ms. SmolLM2-135M fp32, 2 CPU cores.",
        "",
        "| mode | ok | req/s | out tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | goodput req/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, r in results.items():
        m = r["metrics"]
        lines.append(f"| {mode} | {m['completed']}/{m['num_requests']} | {fmt(m['request_throughput'], 2)} | "
                     f"{fmt(m['output_throughput'])} | {fmt(m['ttft_ms']['p50'], 0)} | {fmt(m['ttft_ms']['p99'], 0)} | "
                     f"{fmt(m['tpot_ms']['p50'], 0)} | {fmt(m['tpot_ms']['p99'], 0)} | {fmt(m.get('goodput'), 2)} |")
    lines += ["", f"Command: `{command}`"]
    return "\n".join(lines)


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for mode, r in results.items():
        reqs = [q for q in r["requests"] if q.get("ok")]
        for ax, key in zip(axes, ("ttft", "tpot", "e2e")):
            xs = sorted(q[key + "_s"] * 1000 for q in reqs if q.get(key + "_s") is not None)
            if xs:
                ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=mode)
    for ax, name in zip(axes, ("TTFT", "TPOT", "end-to-end")):
        ax.set(title=f"{name} CDF", xlabel="ms", ylabel="fraction of requests", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--input-len-range", type=int, nargs=2, default=(32, 256), metavar=("LO", "HI"))
    p.add_argument("--output-len-range", type=int, nargs=2, default=(16, 128), metavar=("LO", "HI"))
    p.add_argument("--request-rate", type=float, default=4.0)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-wait-s", type=float, default=0.5, help="dynamic batching's wait")
    p.add_argument("--slo-ttft-ms", type=float, default=5000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=400.0)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--markdown", default=None, help="write the table here")
    p.add_argument("--plot", default=None, help="write latency CDFs here (PNG)")
    p.add_argument("--result-json", default=None)
    args = p.parse_args(argv)
    if "static" in args.modes and args.num_prompts % args.batch_size:
        p.error("static batching needs --num-prompts to be a multiple of --batch-size (full batches)")
    cfg = BenchConfig(base_url="http://127.0.0.1", model=MODEL_NAME, num_prompts=args.num_prompts,
                      request_rate=args.request_rate, input_len_range=tuple(args.input_len_range),
                      output_len_range=tuple(args.output_len_range), vocab_size=49152, seed=args.seed,
                      timeout_s=args.timeout_s, slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms)
    results = {}
    for mode in args.modes:
        print(f"== {mode}", flush=True)
        if mode == "disagg":
            results[mode] = run_disagg(cfg, args.batch_size, args.warmup)
        else:
            results[mode] = run_colocated(mode, cfg, args.batch_size, args.max_wait_s, args.warmup)
    command = "python benchmarks/batching_table.py " + " ".join(argv if argv is not None else sys.argv[1:])
    table = render(results, cfg, args.batch_size, command.strip())
    print(table)
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text("# Batching comparison\n\n" + table + "\n")
    if args.plot:
        plot(results, args.plot)
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(results, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
