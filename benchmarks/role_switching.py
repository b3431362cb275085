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

Every request is greedy with ignore_eos, so each server does the same work. The load is sized to the
host: before any server starts, one worker's engine alone is timed on a long prompt and on a full decode
batch, and each phase arrives at `--load` times what one worker of its busy side serves (one worker
there falls behind, two keep up); the SLOs default to multiples of the same times. Run it on an idle
host; the figures go to docs/guides/role-switching.md.

    .venv/bin/python benchmarks/role_switching.py [--workers 3 --load 1.3 --scale 1.0 --json PATH]
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import drain, fmt, machine_info, print_table, serve_app, write_json  # noqa: E402
from deployments.bench_cli import BenchConfig, Phase, run_benchmark  # noqa: E402
from engine.model_loader import DEFAULT_MODEL_NAME  # noqa: E402


@dataclass
class Calibration:
    """One worker's speed on this host, measured before any server starts: its engine alone, `threads`
    threads, `max_num_seqs` slots."""

    prefill_s: float  # one PROMPT_LEN-token prompt
    step_s: float  # one decode step of a full batch (max_num_seqs sequences)
    max_num_seqs: int

    def prefill_rate(self) -> float:
        """Prompts of PROMPT_LEN tokens one prefill worker computes per second."""
        return 1.0 / self.prefill_s

    def decode_rate(self) -> float:
        """Answers of ANSWER_LEN tokens one decode worker finishes per second (its slots full)."""
        return self.max_num_seqs / (ANSWER_LEN * self.step_s)


PROMPT_LEN, SHORT_ANSWER = 256, 4  # the prefill-heavy phases: summarization-like
SHORT_PROMPT, ANSWER_LEN = 16, 96  # the decode-heavy phase: chat-like


def calibrate(threads: int, max_num_seqs: int) -> Calibration:
    import gc
    import random
    import statistics
    import time

    from engine import EngineConfig, LLMEngine, SamplingParams

    eng = LLMEngine(EngineConfig(num_threads=threads, max_num_seqs=max_num_seqs, kv_cache_memory_mb=256))
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, 20000) for _ in range(n)]

    prefills = []
    for k in range(9):
        eng.add_request(f"p{k}", prompt(PROMPT_LEN), SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        t0 = time.perf_counter()
        drain(eng)
        prefills.append(time.perf_counter() - t0)
    for k in range(max_num_seqs):
        eng.add_request(f"d{k}", prompt(SHORT_PROMPT), SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    eng.step()
    steps = []
    for _ in range(30):
        t0 = time.perf_counter()
        eng.step()
        steps.append(time.perf_counter() - t0)
    drain(eng)
    del eng
    gc.collect()
    return Calibration(statistics.median(prefills[1:]), statistics.median(steps), max_num_seqs)


def phases(cal: Calibration, load: float, scale: float) -> tuple[Phase, ...]:
    """Prefill-heavy, decode-heavy, prefill-heavy, as many requests each: each arriving at `load` times
    what one worker of the busy side serves alone (so one worker there falls behind and two keep up);
    the prefill-heavy ones last about 30 s, the decode-heavy one longer (its answers take longer)."""
    def n(x: float) -> int:
        return max(2, round(x * scale))

    p_rate, d_rate = load * cal.prefill_rate(), load * cal.decode_rate()
    prefill_heavy = Phase(n(30 * p_rate), PROMPT_LEN, SHORT_ANSWER, round(p_rate, 3))
    return (prefill_heavy, Phase(prefill_heavy.num_prompts, SHORT_PROMPT, ANSWER_LEN, round(d_rate, 3)),
            prefill_heavy)


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
    p.add_argument("--load", type=float, default=1.3,
                   help="each phase's arrival rate over what one worker of its busy side serves alone")
    p.add_argument("--max-num-seqs", type=int, default=4, help="decode slots per worker")
    p.add_argument("--local-prefill-max-tokens", type=int, default=0,
                   help="conditional disaggregation in every server (default 0, off: a fixed split is fixed; "
                        "pdserve's default, 512, lets decode workers take prompts of 256 tokens)")
    p.add_argument("--phase", action="append", type=Phase.parse, default=None, metavar="N,IN,OUT,RATE",
                   help="a phase of the load (repeat, in order; default: the sized ones above, by --scale)")
    p.add_argument("--only", default=None, help="run only the servers whose name contains this (calibrating)")
    p.add_argument("--slo-ttft-ms", type=float, default=None,
                   help="default: 6 prompts' time on one worker (at least 3000)")
    p.add_argument("--slo-tpot-ms", type=float, default=None, help="default: 3 decode steps' time on one worker")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    n = args.workers
    splits = [(k, n - k) for k in range(1, n)]
    cal = calibrate(args.threads, args.max_num_seqs)
    print(f"calibration: one {PROMPT_LEN}-token prompt {cal.prefill_s * 1000:.0f} ms, a decode step of "
          f"{args.max_num_seqs} {cal.step_s * 1000:.0f} ms: one worker serves {cal.prefill_rate():.2f} prompts/s "
          f"or {cal.decode_rate():.2f} answers of {ANSWER_LEN} tokens/s", flush=True)
    if args.slo_ttft_ms is None:
        args.slo_ttft_ms = round(max(3000.0, 6000 * cal.prefill_s))
    if args.slo_tpot_ms is None:
        args.slo_tpot_ms = round(3000 * cal.step_s)
    cfg = BenchConfig(base_url="http://unused", model=DEFAULT_MODEL_NAME, vocab_size=20000, seed=7,
                      timeout_s=1800, progress=False, slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms,
                      phases=tuple(args.phase) if args.phase else phases(cal, args.load, args.scale))
    # Each worker is one device's worth: `--threads` threads, no borrowing of idle workers' cores
    # (share_node_cores off), `--max-num-seqs` decode slots; so the split matters as it does on GPUs.
    # NOTE: no TPOT target for the controller: on one CPU host every worker's steps slow down with the
    # whole host's load, so step time does not tell which side lacks workers; slots waited for do.
    common = dict(num_threads=args.threads, worker_num_cpus=0.5, kv_cache_memory_mb=256, share_node_cores=False,
                  max_num_seqs=args.max_num_seqs, prefill_target_queued_tokens=512, decode_target_waiting=1,
                  local_prefill_max_tokens=args.local_prefill_max_tokens)
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
                               "calibration": vars(cal), "phases": [asdict(ph) for ph in cfg.phases],
                               "runs": [{k: v for k, v in r.items() if k != "requests"} for r in runs]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
