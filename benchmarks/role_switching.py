"""A load that shifts, served by a fixed prefill/decode split and by the role controller, side by side in
one run on one host: goodput (requests meeting both the TTFT and the TPOT target) and TTFT/TPOT p50/p99
per phase.

```
 phases (pdserve bench --phase): prefill-heavy (long prompts, short answers)
                                 -> decode-heavy (short prompts, long answers) -> prefill-heavy again
 servers, one after another, same Ray app, same workers in all:
   fixed  P prefill + D decode, for each split (the best of them is the baseline)
   roles  the first split with --role-switching (the controller moves workers between the pools)
```

Every request is greedy with ignore_eos, so each server does the same work. Run it on an idle host;
the figures go to docs/guides/role-switching.md.

    .venv/bin/python benchmarks/role_switching.py [--workers 3 --scale 1.0 --json PATH]
"""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
import sys
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import fmt, machine_info, print_table, serve_app, write_json  # noqa: E402
from deployments.bench_cli import BenchConfig, Phase, run_benchmark  # noqa: E402
from engine.model_loader import DEFAULT_MODEL_NAME  # noqa: E402


def phases(scale: float) -> tuple[Phase, ...]:
    def n(x: int) -> int:
        return max(2, round(x * scale))

    # Sized for one 2-core host with 3 one-thread workers: about one prefill worker's worth too many
    # prompts in the first and last phase, about one decode worker's worth too many answers in the middle.
    return (Phase(n(50), 256, 4, 2.5),   # summarization-like: the prompts are the work
            Phase(n(30), 16, 96, 0.9),   # chat-like: the answers (and the decode slots) are the work
            Phase(n(50), 256, 4, 2.5))


def run_one(name: str, app_args: dict, cfg: BenchConfig, num_cpus: int) -> dict:
    import ray

    from deployments.app import NAMESPACE, ROUTER_NAME

    with serve_app(app_args, num_cpus=num_cpus, direct=True) as url:
        run_benchmark(BenchConfig(base_url=url, model=cfg.model, num_prompts=4, input_len=32, output_len=8,
                                  vocab_size=cfg.vocab_size, progress=False, timeout_s=300))  # warm-up
        res = run_benchmark(replace(cfg, base_url=url))
        stats = ray.get(ray.get_actor(ROUTER_NAME, namespace=NAMESPACE).stats.remote(), timeout=30)
        res["router"] = {"counters": stats["counters"], "roles": stats.get("roles")}
    res["name"] = name
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=3, help="prefill + decode workers in every server")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every phase's request count")
    p.add_argument("--max-num-seqs", type=int, default=4, help="decode slots per worker")
    p.add_argument("--phase", action="append", type=Phase.parse, default=None, metavar="N,IN,OUT,RATE",
                   help="a phase of the load (repeat, in order; default: the sized ones above, by --scale)")
    p.add_argument("--only", default=None, help="run only the servers whose name contains this (calibrating)")
    p.add_argument("--slo-ttft-ms", type=float, default=3000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=300.0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    n = args.workers
    splits = [(k, n - k) for k in range(1, n)]
    cfg = BenchConfig(base_url="http://unused", model=DEFAULT_MODEL_NAME, vocab_size=20000, seed=7,
                      timeout_s=1800, progress=False, slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms,
                      phases=tuple(args.phase) if args.phase else phases(args.scale))
    # Each worker is one device's worth: `--threads` threads, no borrowing of idle workers' cores
    # (share_node_cores off), `--max-num-seqs` decode slots; so the split matters as it does on GPUs.
    # NOTE: no TPOT target for the controller: on one CPU host every worker's steps slow down with the
    # whole host's load, so step time does not tell which side lacks workers; slots waited for do.
    common = dict(num_threads=args.threads, worker_num_cpus=0.5, kv_cache_memory_mb=256, share_node_cores=False,
                  max_num_seqs=args.max_num_seqs, prefill_target_queued_tokens=512, decode_target_waiting=1)
    servers = {f"fixed {pre}P+{dec}D": dict(common, num_prefill_workers=pre, num_decode_workers=dec)
               for pre, dec in splits}
    pre, dec = splits[0] if len(splits) == 1 else splits[len(splits) // 2]
    servers[f"roles from {pre}P+{dec}D"] = dict(common, num_prefill_workers=pre, num_decode_workers=dec,
                                                role_switching=True, role_switch_hold_s=2.0, role_switch_dwell_s=8.0,
                                                ttft_target_ms=args.slo_ttft_ms / 2)
    runs = [run_one(name, app_args, cfg, num_cpus=n + 2) for name, app_args in servers.items()
            if args.only is None or args.only in name]
    rows = []
    for r in runs:
        for ph in r["phases"]:
            rows.append([r["name"], ph["phase"], f"{ph['input_len']}->{ph['output_len']}",
                         fmt(ph["ttft_ms"]["p50"], 0), fmt(ph["ttft_ms"]["p99"], 0), fmt(ph["tpot_ms"]["p50"], 0),
                         fmt(ph["tpot_ms"]["p99"], 0), f"{ph['good_requests']}/{ph['num_requests']}",
                         fmt(ph["goodput"], 3)])
        m = r["metrics"]
        rows.append([r["name"], "all", "", fmt(m["ttft_ms"]["p50"], 0), fmt(m["ttft_ms"]["p99"], 0),
                     fmt(m["tpot_ms"]["p50"], 0), fmt(m["tpot_ms"]["p99"], 0),
                     f"{m['good_requests']}/{m['num_requests']}", fmt(m["goodput"], 3)])
    fixed = [r for r in runs if r["name"].startswith("fixed")]
    roles = [r for r in runs if r["name"].startswith("roles")]
    best_fixed = max(fixed, key=lambda r: r["metrics"]["goodput"]) if fixed else None
    ratio = (roles[0]["metrics"]["goodput"] / max(best_fixed["metrics"]["goodput"], 1e-9)
             if roles and best_fixed else None)
    switches = (roles[0]["router"]["roles"] or {}).get("decisions", []) if roles else []
    notes = [f"SLOs: TTFT <= {args.slo_ttft_ms:g} ms, TPOT <= {args.slo_tpot_ms:g} ms (the controller's TTFT "
             f"target: half; decode by slots waited for)",
             (f"goodput with the controller / best fixed split ({best_fixed['name']}): {ratio:.2f}x"
              if ratio is not None else "goodput ratio: not all servers ran (--only)"),
             "switches: " + "; ".join(f"{d['worker_id']} {d['from']}->{d['to']} at +{d['time'] - switches[0]['time']:.0f}s"
                                      for d in switches) if switches else "switches: none"]
    print_table("role switching on a shifting load", ["server", "phase", "in->out", "TTFT p50", "TTFT p99",
                                                      "TPOT p50", "TPOT p99", "good", "goodput/s"], rows, notes)
    if args.json:
        write_json(args.json, {"machine": machine_info(), "args": vars(args), "ratio": ratio,
                               "runs": [{k: v for k, v in r.items() if k != "requests"} for r in runs]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
