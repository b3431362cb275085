"""engine_throughput.py's rows, tables and JSON report: plain functions over what the run measured."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from benchmarks.common import fmt, machine_info, print_table

if TYPE_CHECKING:
    from benchmarks.common import BenchRequest

# Alternating pairs of steps (torch ops / fused kernels) in the sweep's fused-ops A/B.
FUSED_AB_PAIRS = 6


@dataclass(slots=True)
class RunResult:
    name: str
    output_tokens: int  # requested tokens actually produced
    wall_s: float
    mean_latency_s: float | None = None
    notes: str = ""
    extrapolated: bool = False
    details: dict = field(default_factory=dict)
    load_avg_1m: float | None = None  # host load when the row finished (other processes steal cores)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0


def engine_report(args, m, workload: list[BenchRequest], results: list[RunResult], agreements: dict[str, float],
                  sweep_rows: list[dict], paged_decode: bool, total_s: float) -> dict[str, Any]:
    """Print the throughput table and the decode sweep; return everything as one JSON-able dict.
    `m`: the run's `Roofline` (engine_throughput.py)."""
    roof = m.tokens_per_s
    total_prompt = sum(len(r.prompt_token_ids) for r in workload)
    total_requested = sum(r.max_tokens for r in workload)
    agreement = agreements.get("continuous", next(iter(agreements.values()), None))
    by_name = {r.name: r for r in results}
    cont = by_name.get("pdserve continuous")
    hf_static = by_name.get("HF generate (static, padded)")
    hf_cb = by_name.get("HF continuous batching")
    rows = []
    for r in results:
        # All tokens pushed through the weights (prompt + output) per second, against the roofline:
        # with long prompts, most of the FLOPs are prefill, so output tok/s alone can't approach 100%.
        all_tps = (total_prompt + total_requested) / r.wall_s
        rows.append([r.name + (" *" if r.extrapolated else ""), fmt(r.tokens_per_s), fmt(r.wall_s),
                     fmt(r.mean_latency_s), f"{100 * r.tokens_per_s / roof:.1f}%", f"{100 * all_tps / roof:.1f}%",
                     fmt(cont.tokens_per_s / r.tokens_per_s, 2) + "x" if cont else "-",
                     fmt(r.load_avg_1m), r.notes])
    notes = [
        f"workload: {len(workload)} requests, prompts {args.min_prompt}-{args.max_prompt} "
        f"({total_prompt} prompt tokens), outputs {args.min_output}-{args.max_output} ({total_requested} "
        f"output tokens), seed {args.seed}, greedy, ignore_eos; all requests arrive at t=0",
        f"roofline: best fp32 matmul (torch.mm or prepacked oneDNN) {m.gflops:.1f} GFLOP/s ({', '.join(f'{m}x{k}x{n}: {x.gflops:.0f}' for m, k, n, x in ((r.m, r.k, r.n, r) for r in m.mm_results))}); "
        f"{m.num_params / 1e6:.1f} M params/token -> {roof:.1f} tok/s (best at start {m.gflops_start:.1f}, at end {m.gflops_end:.1f} GFLOP/s)",
        f"output-only ceiling at 100% efficiency for this prompt/output mix: "
        f"{roof * total_requested / (total_prompt + total_requested):.1f} tok/s "
        f"(prefill tokens cost the same FLOPs as output tokens); all-token % roofline = (prompt + output tokens)/s",
        "load 1m: host 1-minute load average after the row (2 cores; > 2 means other processes were competing)",
        f"engine: max_num_seqs={args.max_num_seqs}, max_num_batched_tokens={args.max_num_batched_tokens}, "
        f"threads={args.threads}; HF static batch size {args.hf_batch_size}",
    ]
    if agreement is not None:
        notes.append(f"greedy agreement, first 16 tokens, pdserve vs HF continuous batching: {100 * agreement:.0f}% of requests"
                     + "".join(f"; {key}: {100 * a:.0f}%" for key, a in agreements.items() if "KV" in key))
    if hf_static and hf_static.extrapolated:
        notes.append("* extrapolated: " + hf_static.notes)
    targets = []
    if cont and hf_static:
        targets.append(f"continuous / HF static = {cont.tokens_per_s / hf_static.tokens_per_s:.2f}x (target >= 4x)")
    if cont and hf_cb:
        targets.append(f"continuous / HF continuous = {cont.tokens_per_s / hf_cb.tokens_per_s:.2f}x (target >= 3x)")
    for kv in dict.fromkeys(r["kv_cache_dtype"] for r in sweep_rows):
        top = max((r for r in sweep_rows if r["kv_cache_dtype"] == kv), key=lambda r: r["batch"])
        targets.append(f"decode at batch {top['batch']}, KV {kv}: {top['pct_roofline']:.1f}% of roofline (target >= 70%); "
                       f"{top['pct_bound']:.1f}% of the matmul + KV-read bound ({fmt(top['bound_tokens_per_s'])} tok/s "
                       f"= {100 * top['bound_tokens_per_s'] / roof:.1f}% of roofline)")
    if cont:
        targets.append(f"continuous end to end: {100 * cont.tokens_per_s / roof:.1f}% of roofline")
    print_table("Offline throughput (output tokens/s)",
                ["system", "out tok/s", "wall s", "mean latency s", "out % roofline", "all-token % roofline",
                 "continuous is", "load 1m", "notes"],
                rows, notes + targets)
    if sweep_rows:
        print_table(f"Decode-only batch sweep (~{args.sweep_context}-token contexts, {args.sweep_steps} steps)",
                    ["KV", "batch", "tok/s", "% roofline", "step ms", "linears-only ms", "other ms", "attention-only ms",
                     "linears-only % roofline", "KV read MB", "attention GB/s", "bound tok/s", "% bound",
                     "fused ops speedup"],
                    [[r["kv_cache_dtype"], r["batch"], fmt(r["tokens_per_s"]), f"{r['pct_roofline']:.1f}%", fmt(r["median_step_ms"]),
                      fmt(r["linear_only_ms"]), fmt(r["non_linear_ms"]), fmt(r["attention_only_ms"]),
                      f"{r['linear_only_pct_roofline']:.1f}%", fmt(r["kv_read_mb"]),
                      fmt(r["kv_read_mb"] / r["attention_only_ms"]) if r["attention_only_ms"] else "-",
                      fmt(r["bound_tokens_per_s"]), f"{r['pct_bound']:.1f}%",
                      fmt(r["torch_ops_step_ms"] / r["fused_ops_step_ms"], 2) + "x" if r["fused_ops_step_ms"] else "-"]
                     for r in sweep_rows],
                    ["linears-only: the same step's q/k/v/o/gate/up/down + lm_head matmuls alone (the engine's, "
                     "best of 5); other = step - linears (attention, KV writes, norms, rope, metadata, sampling); "
                     "attention-only: the step's decode attention alone (all layers, the sequences' own blocks, "
                     "best of 3), and the KV it reads per second",
                     f"fused ops speedup: median step with the per-token ops as torch ops / fused (engine/csrc), "
                     f"{FUSED_AB_PAIRS} alternating pairs of steps at the same batch",
                     f"bound: matmuls at the roofline + one read of the step's KV at {m.read_gbs:.1f} GB/s (streaming "
                     "read, measured in this run); attention reads every cached token of every sequence each step, "
                     "which the matmul roofline leaves out",
                     f"decode attention: {'compiled CPU kernel (paged, one read of the cache)' if paged_decode else 'gather + SDPA'}",
                     "KV: the cache's element type (auto = the model's fp32); narrower rounds K and V when stored, "
                     "the math stays fp32"])
    print(f"total benchmark time {total_s:.0f} s")
    return {
        "machine": machine_info(), "args": vars(args), "read_bandwidth_gbs": m.read_gbs, "roofline": {
            "gflops": m.gflops, "gflops_start": m.gflops_start, "gflops_end": m.gflops_end, "params_per_token": m.num_params,
            "tokens_per_s": roof,
            "matmuls": [{"m": r.m, "k": r.k, "n": r.n, "gflops": r.gflops, "mm_gflops": r.mm_gflops,
                         "onednn_gflops": r.onednn_gflops} for r in m.mm_results]},
        "workload": {"num_requests": len(workload), "prompt_tokens": total_prompt, "output_tokens": total_requested},
        "results": [{"name": r.name, "output_tokens": r.output_tokens, "wall_s": r.wall_s,
                     "tokens_per_s": r.tokens_per_s, "pct_roofline": 100 * r.tokens_per_s / roof,
                     "mean_latency_s": r.mean_latency_s, "extrapolated": r.extrapolated, "notes": r.notes,
                     "all_token_pct_roofline": 100 * (total_prompt + total_requested) / r.wall_s / roof,
                     "load_avg_1m": r.load_avg_1m,
                     "details": r.details} for r in results],
        "greedy_agreement_first16": agreement, "greedy_agreement_first16_by_run": agreements, "decode_sweep": sweep_rows, "targets": targets,
        "total_benchmark_s": total_s,
    }
