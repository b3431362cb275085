"""Offline throughput: this engine (static / dynamic / continuous batching) vs transformers on CPU.

    .venv/bin/python benchmarks/engine_throughput.py [--quick] [--json results.json]

One process, one thread count, one workload (a burst of random-token prompts with per-request output
lengths, greedy, ignore_eos), SmolLM2-135M fp32. Rows:

  * pdserve static / dynamic / continuous: `LLMEngine` with that batching policy, all requests added
    at t=0, stepped until done.
  * HF generate (static, padded): transformers `generate` on left-padded batches of `--hf-batch-size`
    in arrival order; each batch runs to its longest max_new_tokens (min_new_tokens = max_new_tokens,
    so EOS never stops it early); only the tokens each request asked for count as output.
  * HF continuous batching: transformers' own continuous batching (the manager that `generate_batch`
    wraps). `generate_batch` takes a single `max_new_tokens` for all prompts, so this drives the same
    manager through `continuous_batching_context_manager` + `add_request(..., max_new_tokens=n)`,
    which gives every request its own length: the same work as our rows. Its start-up (cache
    allocation, warmup) is timed separately and not counted.
  * pdserve continuous, TP N (`--tensor-parallel-size N`, N > 1): the continuous policy with the model
    split over N processes on this host (gloo; `engine.parallel.launch_local`), `--threads` shared
    out among the ranks (at least one each); the followers' KV pools are not pre-touched.
  * pdserve continuous, KV bfloat16 / fp8_e5m2 (`--kv-cache-dtypes`): the same engine with its KV
    cache in a narrower element type (K and V rounded when stored; the math stays fp32), and how far
    its greedy text stays with transformers'.

The roofline is the best fp32 matmul GFLOP/s measured in this run (torch.mm or oneDNN with a
prepacked weight, whichever is faster; model-shaped and one large
square shape) divided by 2 x params per token (non-embedding params + the lm_head; a tied embedding
counts once, as the lm_head). A "decode-only batch sweep" then measures steady decode at fixed batch
sizes and ~`--sweep-context` tokens of context, next to the time the same step spends in its linear
layers alone and its decode attention alone, which separates GEMM efficiency at small batch from the
KV-cache read and the rest of the per-step overhead (norms, rope, metadata, sampling, Python);
once per KV cache element type.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import (BenchRequest, add_workload_args, make_workload, measure_read_bandwidth,
                               measure_roofline, params_per_token, roofline_tokens_per_s, touch_kv_pool, warm_up,
                               write_json)
from benchmarks.decode_sweep import decode_sweep, sweep_max_tokens
from benchmarks.engine_throughput_report import RunResult, engine_report
from benchmarks.hf_baselines import run_hf_continuous, run_hf_static
from engine import EngineConfig, LLMEngine, SamplingParams

POLICIES = ("static", "dynamic", "continuous")


# ---------------------------------------------------------------------------------------------- pdserve


def build_engine(args, policy: str, max_num_seqs: int | None = None, kv_cache_mb: int | None = None,
                 kv_cache_dtype: str = "auto") -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=args.model, num_threads=args.threads, batching=policy,
        max_num_seqs=max_num_seqs or args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_mb=kv_cache_mb or args.kv_cache_mb, max_wait_s=args.max_wait_s,
        kv_cache_dtype=kv_cache_dtype))


def run_pdserve(engine: LLMEngine, workload: list[BenchRequest], policy: str) -> tuple[RunResult, dict]:
    rids = [f"req-{i}" for i in range(len(workload))]
    finish: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    num_steps = prefill_steps = 0
    decode_only_s = mixed_s = 0.0
    decode_rows = 0
    t0 = time.perf_counter()
    for rid, r in zip(rids, workload):
        engine.add_request(rid, r.prompt_token_ids,
                           SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True))
    engine.scheduler.draining = True  # a burst: nothing else is coming
    while engine.has_unfinished_requests():
        outs = engine.step()
        st = engine.last_step
        if st.num_seqs:
            num_steps += 1
            if st.num_prefill_tokens:
                prefill_steps += 1
                mixed_s += st.duration_s
            else:
                decode_only_s += st.duration_s
                decode_rows += st.num_decode_tokens
        for out in outs:
            if out.finished:
                finish[out.request_id] = time.perf_counter() - t0
                tokens[out.request_id] = out.token_ids
    wall = time.perf_counter() - t0
    engine.scheduler.draining = False
    produced = sum(min(len(tokens[rid]), r.max_tokens) for rid, r in zip(rids, workload))
    assert all(len(tokens[rid]) == r.max_tokens for rid, r in zip(rids, workload)), "short output"
    decode_steps = num_steps - prefill_steps
    details = {
        "steps": num_steps, "steps_with_prefill": prefill_steps, "decode_only_steps": decode_steps,
        "time_in_steps_with_prefill_s": mixed_s, "time_in_decode_only_steps_s": decode_only_s,
        "mean_decode_batch": decode_rows / decode_steps if decode_steps else 0.0,
        "engine_overhead_outside_step_s": wall - mixed_s - decode_only_s,
    }
    res = RunResult(f"pdserve {policy}", produced, wall,
                    sum(finish.values()) / len(finish), details=details,
                    notes=f"{num_steps} steps, mean decode batch {details['mean_decode_batch']:.1f}")
    return res, {rid: tokens[rid] for rid in rids}


# ---------------------------------------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF dir / hub id; default: embedded SmolLM2-135M-Instruct")
    p.add_argument("--threads", type=int, default=2)
    add_workload_args(p)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--kv-cache-mb", type=int, default=2048)
    p.add_argument("--max-wait-s", type=float, default=0.05)
    p.add_argument("--policies", default=",".join(POLICIES), help="comma list of our batching policies")
    p.add_argument("--hf-batch-size", type=int, default=None, help="HF static batch size (default: max-num-seqs)")
    p.add_argument("--hf-static-requests", type=int, default=None,
                   help="run HF static on only the first N requests and extrapolate (said so in the table)")
    p.add_argument("--skip-hf-static", action="store_true")
    p.add_argument("--skip-hf-cb", action="store_true")
    p.add_argument("--sweep-batches", default="1,8,32,64")
    p.add_argument("--sweep-context", type=int, default=256)
    p.add_argument("--sweep-steps", type=int, default=24)
    p.add_argument("--skip-sweep", action="store_true")
    p.add_argument("--kv-cache-dtypes", default="auto,bfloat16,fp8_e5m2",
                   help="KV cache element types to run the continuous policy and the decode sweep with "
                        "(auto = fp32, the model's; each extra one adds a continuous row and a sweep)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="N > 1: add a continuous row with the model split over N local processes (gloo)")
    p.add_argument("--quick", action="store_true",
                   help="16 requests, prompts 32-128, outputs 8-32, sweep of 6 steps (a smoke test)")
    p.add_argument("--json", default=None, help="write all results here")
    args = p.parse_args(argv)
    if args.quick:
        args.num_requests, args.max_prompt, args.min_output, args.max_output = 16, 128, 8, 32
        args.sweep_steps = 6
        args.sweep_batches = "1,8,16"
    args.hf_batch_size = args.hf_batch_size or args.max_num_seqs
    return args


@dataclass(slots=True)
class Roofline:
    """What this machine's matmuls and memory reads allow, measured in this run (best of start and end)."""

    shapes: list[tuple[int, int, int]]
    num_params: int
    gflops: float = 0.0
    gflops_start: float = 0.0
    gflops_end: float = 0.0
    mm_results: list = field(default_factory=list)
    read_gbs: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return roofline_tokens_per_s(self.gflops, self.num_params)

    def measure_start(self) -> None:
        self.gflops, self.mm_results = measure_roofline(self.shapes)
        self.gflops_start = self.gflops
        self.read_gbs = measure_read_bandwidth()

    def measure_end(self, sweep_rows: list[dict]) -> None:
        """The roofline again, to see whether the machine changed under us (shared hosts); keep the best,
        and express the sweep against it."""
        self.gflops_end, mm_end = measure_roofline(self.shapes)
        self.read_gbs = max(self.read_gbs, measure_read_bandwidth())
        best = roofline_tokens_per_s(max(self.gflops, self.gflops_end), self.num_params)
        for row in sweep_rows:
            # The step cannot beat its matmuls at the roofline plus one read of its KV at the streaming
            # read bandwidth (both measured in this run): the roofline counts only the first.
            row["bound_tokens_per_s"] = row["batch"] / (row["batch"] / best + row["kv_read_mb"] * 1e6 / (self.read_gbs * 1e9))
            row["pct_bound"] = 100 * row["tokens_per_s"] / row["bound_tokens_per_s"]
        if self.gflops_end > self.gflops:
            self.gflops, self.mm_results = self.gflops_end, mm_end
            for row in sweep_rows:  # re-express the sweep against the better roofline
                row["pct_roofline"] = 100 * row["tokens_per_s"] / self.tokens_per_s
                row["linear_only_pct_roofline"] = 100 * row["linear_only_tokens_per_s"] / self.tokens_per_s


def _fresh_engine(engine: LLMEngine | None, args, policy: str, **kwargs) -> LLMEngine:
    """A new engine for the next row, the previous one's memory freed first."""
    del engine
    gc.collect()
    return build_engine(args, policy, **kwargs)


def _timed_row(results: list[RunResult], res: RunResult) -> RunResult:
    res.load_avg_1m = os.getloadavg()[0]
    results.append(res)
    print(f"  {res.name}: {res.tokens_per_s:.1f} tok/s, {res.wall_s:.1f} s", flush=True)
    return res


def run_our_rows(args, engine: LLMEngine, policies: list[str], kv_dtypes: list[str], workload: list[BenchRequest],
                 results: list[RunResult]) -> tuple[LLMEngine, dict[str, dict]]:
    """Each batching policy, then continuous with each narrower KV cache; returns the last engine and
    each row's tokens."""
    outputs: dict[str, dict] = {}
    for i, policy in enumerate(policies):
        engine = engine if i == 0 else _fresh_engine(engine, args, policy)
        warm_up(engine)
        res, outputs[policy] = run_pdserve(engine, workload, policy)
        _timed_row(results, res)
    for kv in kv_dtypes:
        if kv == "auto" or "continuous" not in policies:
            continue
        engine = _fresh_engine(engine, args, "continuous", kv_cache_dtype=kv)
        warm_up(engine)
        res, toks = run_pdserve(engine, workload, "continuous")
        res.name = f"pdserve continuous, KV {kv}"
        outputs[f"continuous, KV {kv}"] = toks
        _timed_row(results, res)
    return engine, outputs


def run_tp_row(args, workload: list[BenchRequest], results: list[RunResult], outputs: dict[str, dict]) -> None:
    """The continuous policy with the model split over `--tensor-parallel-size` local processes."""
    n = args.tensor_parallel_size
    if n <= 1:
        return
    from engine.parallel import launch_local

    threads = max(1, args.threads // n)
    engine = launch_local(EngineConfig(
        model=args.model, num_threads=threads, batching="continuous", max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory_mb=args.kv_cache_mb,
        tensor_parallel_size=n))
    try:
        warm_up(engine)
        res, outputs[f"continuous, TP {n}"] = run_pdserve(engine, workload, "continuous")
        res.name = f"pdserve continuous, TP {n} ({threads} thread{'s' if threads > 1 else ''} a rank)"
        _timed_row(results, res)
    finally:
        engine.close()


def run_hf_rows(args, model, workload: list[BenchRequest], pad_id: int, results: list[RunResult]) -> dict | None:
    """transformers' static and continuous batching; returns the latter's tokens (the reference)."""
    if not args.skip_hf_static:
        _timed_row(results, run_hf_static(model, workload, args.hf_batch_size, pad_id, args.hf_static_requests))
    if args.skip_hf_cb:
        return None
    res, tokens = run_hf_continuous(model, workload, args.max_num_seqs, args.max_num_batched_tokens, pad_id)
    _timed_row(results, res)
    return tokens


def greedy_agreement(outputs: dict[str, dict], reference: dict | None, n: int) -> dict[str, float]:
    """Per row, the share of requests whose first 16 greedy tokens equal transformers' (fp32 kernels
    differ, so late drift is fine; for a narrower KV cache, how much its rounding changes the text)."""
    if reference is None:
        return {}
    return {key: sum(toks[f"req-{k}"][:16] == reference[f"req-{k}"][:16] for k in range(n)) / n
            for key, toks in outputs.items()}


def run_sweep(args, engine: LLMEngine, kv_dtypes: list[str], roof: float, vocab: int) -> tuple[LLMEngine, list[dict]]:
    """The decode-only batch sweep, once per KV element type."""
    batches = [int(b) for b in args.sweep_batches.split(",") if b]
    # NOTE: the sweep must never preempt: size the KV cache for the largest batch at its final length.
    cfg = engine.hf_model.config
    block_mb = 2 * cfg.num_hidden_layers * 16 * cfg.num_key_value_heads * cfg.head_dim * 4 / 2**20
    final_len = args.sweep_context + sweep_max_tokens(max(batches), args.sweep_context, args.sweep_steps,
                                                      args.max_num_batched_tokens)
    blocks = max(batches) * -(-final_len // 16)
    kv_mb = max(args.kv_cache_mb, int(blocks * block_mb * 1.1) + 1)  # fp32 size: enough for any dtype
    rows: list[dict] = []
    for kv in kv_dtypes:
        engine = _fresh_engine(engine, args, "continuous", max_num_seqs=max(max(batches), args.max_num_seqs),
                               kv_cache_mb=kv_mb, kv_cache_dtype=kv)
        touch_kv_pool(engine)
        try:
            rows += decode_sweep(engine, batches, args.sweep_context, args.sweep_steps, roof, vocab, args.seed)
        except Exception as exc:  # keep the main table: it took most of the run
            print(f"decode sweep (KV {kv}) failed: {exc!r}", flush=True)
    return engine, rows


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    policies = [p for p in args.policies.split(",") if p]
    kv_dtypes = [d for d in args.kv_cache_dtypes.split(",") if d] or ["auto"]
    t_start = time.perf_counter()
    engine = build_engine(args, policies[0] if policies else "continuous")
    model = engine.hf_model
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else engine.tokenizer.eos_token_id
    h, i = model.config.hidden_size, model.config.intermediate_size
    machine = Roofline([(64, h, i), (64, i, h), (256, h, i), (args.max_num_batched_tokens, h, i), (2048, 2048, 2048)],
                       params_per_token(model))
    machine.measure_start()
    workload = make_workload(args.num_requests, (args.min_prompt, args.max_prompt),
                             (args.min_output, args.max_output), model.config.vocab_size, seed=args.seed)
    results: list[RunResult] = []
    engine, outputs = run_our_rows(args, engine, policies, kv_dtypes, workload, results)
    run_tp_row(args, workload, results, outputs)
    agreements = greedy_agreement(outputs, run_hf_rows(args, engine.hf_model, workload, pad_id, results), len(workload))
    sweep_rows: list[dict] = []
    if not args.skip_sweep:
        engine, sweep_rows = run_sweep(args, engine, kv_dtypes, machine.tokens_per_s, model.config.vocab_size)
    machine.measure_end(sweep_rows)
    report = engine_report(args, machine, workload, results, agreements, sweep_rows, engine.runner.paged_decode,
                           time.perf_counter() - t_start)
    if args.json:
        write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
