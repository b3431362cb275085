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

from benchmarks.common import (BenchRequest, add_workload_args, fmt, machine_info, make_workload,
                               measure_read_bandwidth, measure_roofline, params_per_token, print_table,
                               roofline_tokens_per_s, touch_kv_pool, warm_up, write_json)
from engine import EngineConfig, LLMEngine, SamplingParams

POLICIES = ("static", "dynamic", "continuous")


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


# ---------------------------------------------------------------------------------------------- transformers


@torch.inference_mode()
def run_hf_static(model, workload: list[BenchRequest], batch_size: int, pad_id: int,
                  max_requests: int | None) -> RunResult:
    from transformers import GenerationConfig

    total_requested = sum(r.max_tokens for r in workload)
    subset = workload if not max_requests else workload[:max_requests]
    produced = 0
    finish: list[float] = []
    generated_incl_waste = 0
    t0 = time.perf_counter()
    for b in range(0, len(subset), batch_size):
        batch = subset[b:b + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):  # left padding
            n = len(r.prompt_token_ids)
            ids[i, width - n:] = torch.tensor(r.prompt_token_ids)
            mask[i, width - n:] = 1
        longest = max(r.max_tokens for r in batch)
        gcfg = GenerationConfig(max_new_tokens=longest, min_new_tokens=longest, do_sample=False,
                                pad_token_id=pad_id, eos_token_id=None)
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gcfg)
        new = out.shape[1] - width
        assert new == longest, f"HF generate stopped at {new} of {longest} tokens"
        generated_incl_waste += new * len(batch)
        produced += sum(min(new, r.max_tokens) for r in batch)
        finish += [time.perf_counter() - t0] * len(batch)
    wall = time.perf_counter() - t0
    subset_requested = sum(r.max_tokens for r in subset)
    res = RunResult("HF generate (static, padded)", produced, wall, sum(finish) / len(finish),
                    details={"batch_size": batch_size, "requests_run": len(subset),
                             "generated_incl_padding_waste": generated_incl_waste,
                             "measured_wall_s": wall, "measured_output_tokens": produced})
    res.notes = f"batch {batch_size}, {generated_incl_waste - produced} wasted tokens"
    if len(subset) < len(workload):
        # NOTE: extrapolate at the measured tokens/s; wall time scaled to the full workload's tokens.
        res.extrapolated = True
        res.wall_s = wall * total_requested / subset_requested
        res.output_tokens = total_requested
        res.mean_latency_s = None
        res.notes = (f"EXTRAPOLATED from first {len(subset)}/{len(workload)} requests "
                     f"({wall:.0f} s measured); " + res.notes)
    return res


def run_hf_continuous(model, workload: list[BenchRequest], max_num_seqs: int, max_batch_tokens: int,
                      pad_id: int) -> tuple[RunResult, dict]:
    """NOTE: not under inference_mode: the manager builds its buffers here and updates them in place on
    its own thread (which runs under no_grad only); inference tensors would refuse that."""
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    gcfg = GenerationConfig(do_sample=False, max_new_tokens=max(r.max_tokens for r in workload),
                            eos_token_id=-1, pad_token_id=pad_id)
    cbcfg = ContinuousBatchingConfig(max_requests_per_batch=max_num_seqs, max_batch_tokens=max_batch_tokens)
    hints = WorkloadHints(max_prompt_length=max(len(r.prompt_token_ids) for r in workload),
                          max_generated_length=max(r.max_tokens for r in workload), num_requests=len(workload))
    attn_before = model.config._attn_implementation
    t_setup = time.perf_counter()
    with model.continuous_batching_context_manager(generation_config=gcfg, continuous_batching_config=cbcfg,
                                                   block=True, timeout=10, workload_hints=hints) as manager:
        setup_s = time.perf_counter() - t_setup
        t0 = time.perf_counter()
        rids = [manager.add_request(r.prompt_token_ids, request_id=f"req-{i}", max_new_tokens=r.max_tokens,
                                    eos_token_id=-1) for i, r in enumerate(workload)]
        if None in rids:
            raise RuntimeError("transformers' continuous batching manager refused a request")
        results, finish = {}, {}
        while len(results) < len(rids):
            res = manager.get_result(timeout=1)
            if res is not None and res.is_finished():
                results[res.request_id] = res
                finish[res.request_id] = time.perf_counter() - t0
            elif res is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching loop died")
        wall = time.perf_counter() - t0
    if model.config._attn_implementation != attn_before:  # it may switch implementations
        model.set_attn_implementation(attn_before)
    tokens = {rid: list(results[rid].generated_tokens) for rid in rids}
    produced = sum(min(len(tokens[rid]), r.max_tokens) for rid, r in zip(rids, workload))
    if produced == 0:
        raise RuntimeError("transformers' continuous batching produced no tokens (see its log above)")
    out = RunResult("HF continuous batching", produced, wall, sum(finish.values()) / len(finish),
                    details={"setup_s_not_counted": setup_s},
                    notes=f"per-request max_new_tokens; setup {setup_s:.1f} s not counted")
    return out, tokens


# ---------------------------------------------------------------------------------------------- sweep


def best_of(fn, reps: int) -> float:
    """Fastest of `reps` timed calls of `fn`, after one untimed warm-up call."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


@torch.inference_mode()
def linear_only_step_s(runner, batch: int, reps: int = 5) -> float:
    """Seconds one decode step of `batch` rows spends in the model's linear layers alone (all layers'
    fused q/k/v, o, fused gate/up, down, plus the lm_head), through the engine's own matmuls."""
    cfg = runner.config
    x = torch.randn(batch, cfg.hidden_size)
    xi = torch.randn(batch, cfg.intermediate_size)
    xo = torch.randn(batch, runner.num_heads * runner.head_dim)

    def once():
        for li in range(runner.num_layers):
            runner.model.lin_qkv[li](x), runner.model.lin_o[li](xo)
            runner.model.lin_gate_up[li](x), runner.model.lin_down[li](xi)
        runner.model.lin_head(x)

    return best_of(once, reps)


@torch.inference_mode()
def attention_only_step_s(engine: LLMEngine, reps: int = 3) -> float | None:
    """Seconds the decode attention of one step over the running sequences takes alone (every layer,
    the compiled kernel, the sequences' own blocks): the part of "other" that reads the KV cache.
    None where decode attention does not run through the kernel."""
    runner = engine.runner
    if not runner.paged_decode:
        return None
    from engine.attention import AttentionMetadata, paged_attention, paged_decode_meta
    seqs = list(engine.scheduler.running)
    lens = [r.num_tokens for r in seqs]
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), [], [],
                             paged_decode_meta(list(range(len(seqs))), [r.block_table for r in seqs], lens,
                                               runner.block_size))
    q = torch.randn(len(seqs), runner.num_heads, runner.head_dim)

    def once():
        for li in range(runner.num_layers):
            paged_attention(q, None, None, runner.kv_cache[:, li, 0], runner.kv_cache[:, li, 1], meta, runner.scale)

    return best_of(once, reps)


FUSED_AB_PAIRS = 6


def fused_ops_ab(engine: LLMEngine, batch: int, pairs: int = FUSED_AB_PAIRS) -> tuple[float, float] | None:
    """Median decode-step seconds with the model's per-token ops as torch ops, then fused
    (`cpu_kernels`), from `pairs` alternating steps of the same batch: a paired comparison, so host
    noise hits both sides alike. None where the fused ops do not run."""
    runner = engine.runner
    if not runner.fused_ops:
        return None
    times: dict[bool, list[float]] = {False: [], True: []}
    try:
        for _ in range(pairs):
            for fused in (False, True):
                runner.fused_ops = fused
                engine.step()
                st = engine.last_step
                assert st.num_decode_tokens == batch and st.num_prefill_tokens == 0, st
                times[fused].append(st.duration_s)
    finally:
        runner.fused_ops = True
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    return med[False], med[True]


def sweep_max_tokens(batch: int, context: int, num_steps: int, token_budget: int) -> int:
    """Early requests start decoding while later ones still prefill (one budget per step), so each
    request must be allowed the prefill steps plus the timed steps, with margin."""
    return num_steps + 2 * FUSED_AB_PAIRS + 2 * (-(-batch * context // token_budget)) + 8


def kv_bytes_per_token(engine: LLMEngine) -> int:
    """Bytes of K and V one cached token holds over all layers (what decode attention reads per token)."""
    return engine.runner.kv_block_bytes(engine.hf_model.config, 1, engine.runner.kv_dtype)


def decode_sweep(engine: LLMEngine, batch_sizes: list[int], context: int, num_steps: int,
                 roofline_tps: float, vocab: int, seed: int) -> list[dict]:
    rows = []
    workload = make_workload(max(batch_sizes), (context, context), (1, 1), vocab, seed=seed + 1)
    budget = engine.config.max_num_batched_tokens
    for bsz in batch_sizes:
        rids = [f"sweep-{bsz}-{i}" for i in range(bsz)]
        max_tokens = sweep_max_tokens(bsz, context, num_steps, budget)
        for rid, r in zip(rids, workload):
            engine.add_request(rid, r.prompt_token_ids,
                               SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        # Prefill everything (several steps under the token budget), then one warm decode step.
        while True:
            engine.step()
            st = engine.last_step
            if st.num_prefill_tokens == 0 and st.num_decode_tokens == bsz:
                break
        durations = []
        ctx_start = sum(r.num_tokens for r in engine.scheduler.running)
        t0 = time.perf_counter()
        for _ in range(num_steps):
            engine.step()
            st = engine.last_step
            assert st.num_decode_tokens == bsz and st.num_prefill_tokens == 0 and not st.num_preempted, st
            durations.append(st.duration_s)
        wall = time.perf_counter() - t0
        ctx_end = sum(r.num_tokens for r in engine.scheduler.running)
        attn_s = attention_only_step_s(engine)
        ab = fused_ops_ab(engine, bsz)
        for rid in rids:
            engine.abort(rid)
        tps = bsz * num_steps / wall
        step_s = sorted(durations)[len(durations) // 2]
        lin_s = linear_only_step_s(engine.runner, bsz)
        rows.append({"kv_cache_dtype": engine.config.kv_cache_dtype, "batch": bsz, "context": context,
                     "tokens_per_s": tps, "pct_roofline": 100 * tps / roofline_tps,
                     "median_step_ms": 1e3 * step_s, "linear_only_ms": 1e3 * lin_s,
                     "non_linear_ms": 1e3 * (step_s - lin_s),
                     "attention_only_ms": None if attn_s is None else 1e3 * attn_s,
                     "torch_ops_step_ms": None if ab is None else 1e3 * ab[0],
                     "fused_ops_step_ms": None if ab is None else 1e3 * ab[1],
                     "linear_only_tokens_per_s": bsz / lin_s,
                     "linear_only_pct_roofline": 100 * bsz / lin_s / roofline_tps,
                     # KV read by attention per step (mean over the timed steps), for the bound below
                     "kv_read_mb": kv_bytes_per_token(engine) * (ctx_start + ctx_end) / 2 / 1e6})
    return rows


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


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    policies = [p for p in args.policies.split(",") if p]
    t_start = time.perf_counter()

    engine = build_engine(args, policies[0] if policies else "continuous")
    model = engine.hf_model
    vocab = model.config.vocab_size
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else engine.tokenizer.eos_token_id
    num_params = params_per_token(model)

    h, i = model.config.hidden_size, model.config.intermediate_size
    shapes = [(64, h, i), (64, i, h), (256, h, i), (args.max_num_batched_tokens, h, i), (2048, 2048, 2048)]
    gflops, mm_results = measure_roofline(shapes)
    gflops_start = gflops
    read_gbs = measure_read_bandwidth()
    roof = roofline_tokens_per_s(gflops, num_params)

    workload = make_workload(args.num_requests, (args.min_prompt, args.max_prompt),
                             (args.min_output, args.max_output), vocab, seed=args.seed)
    total_prompt = sum(len(r.prompt_token_ids) for r in workload)
    total_requested = sum(r.max_tokens for r in workload)

    results: list[RunResult] = []
    outputs: dict[str, dict] = {}
    for policy in policies:
        if engine is None:
            engine = build_engine(args, policy)
        warm_up(engine)
        res, toks = run_pdserve(engine, workload, policy)
        res.load_avg_1m = os.getloadavg()[0]
        results.append(res)
        outputs[policy] = toks
        print(f"  {res.name}: {res.tokens_per_s:.1f} tok/s, {res.wall_s:.1f} s", flush=True)
        if policy != policies[-1]:
            del engine
            gc.collect()
            engine = None
    kv_dtypes = [d for d in args.kv_cache_dtypes.split(",") if d] or ["auto"]
    for kv in kv_dtypes:
        if kv == "auto" or "continuous" not in policies:
            continue
        del engine
        gc.collect()
        engine = build_engine(args, "continuous", kv_cache_dtype=kv)
        warm_up(engine)
        res, toks = run_pdserve(engine, workload, "continuous")
        res.name = f"pdserve continuous, KV {kv}"
        res.load_avg_1m = os.getloadavg()[0]
        results.append(res)
        outputs[f"continuous, KV {kv}"] = toks
        print(f"  {res.name}: {res.tokens_per_s:.1f} tok/s, {res.wall_s:.1f} s", flush=True)
    if engine is None:
        engine = build_engine(args, "continuous")
    model = engine.hf_model

    if not args.skip_hf_static:
        res = run_hf_static(model, workload, args.hf_batch_size, pad_id, args.hf_static_requests)
        res.load_avg_1m = os.getloadavg()[0]
        results.append(res)
        print(f"  {res.name}: {res.tokens_per_s:.1f} tok/s, {res.wall_s:.1f} s", flush=True)
    hf_cb_tokens = None
    if not args.skip_hf_cb:
        res, hf_cb_tokens = run_hf_continuous(model, workload, args.max_num_seqs, args.max_num_batched_tokens, pad_id)
        res.load_avg_1m = os.getloadavg()[0]
        results.append(res)
        print(f"  {res.name}: {res.tokens_per_s:.1f} tok/s, {res.wall_s:.1f} s", flush=True)

    # Greedy agreement with transformers on the first 16 tokens (fp32 kernels differ, so late drift is
    # fine); for a narrower KV cache, how much its rounding changes the text.
    agreement, agreements = None, {}
    if hf_cb_tokens is not None:
        for key, toks in outputs.items():
            same = sum(toks[f"req-{k}"][:16] == hf_cb_tokens[f"req-{k}"][:16] for k in range(len(workload)))
            agreements[key] = same / len(workload)
        agreement = agreements.get("continuous", next(iter(agreements.values()), None))

    sweep_rows = []
    if not args.skip_sweep:
        batches = [int(b) for b in args.sweep_batches.split(",") if b]
        # NOTE: the sweep must never preempt: size the KV cache for the largest batch at its final length.
        cfg = engine.hf_model.config
        block_mb = 2 * cfg.num_hidden_layers * 16 * cfg.num_key_value_heads * cfg.head_dim * 4 / 2**20
        most = max(batches)
        final_len = args.sweep_context + sweep_max_tokens(most, args.sweep_context, args.sweep_steps,
                                                          args.max_num_batched_tokens)
        blocks = most * -(-final_len // 16)
        kv_mb = max(args.kv_cache_mb, int(blocks * block_mb * 1.1) + 1)  # fp32 size: enough for any dtype
        for kv in kv_dtypes:
            del engine
            gc.collect()
            engine = build_engine(args, "continuous", max_num_seqs=max(max(batches), args.max_num_seqs),
                                  kv_cache_mb=kv_mb, kv_cache_dtype=kv)
            touch_kv_pool(engine)
            try:
                sweep_rows += decode_sweep(engine, batches, args.sweep_context, args.sweep_steps, roof, vocab,
                                           args.seed)
            except Exception as exc:  # keep the main table: it took most of the run
                print(f"decode sweep (KV {kv}) failed: {exc!r}", flush=True)

    # The roofline again, to see whether the machine changed under us (shared hosts); keep the best.
    gflops_end, mm_end = measure_roofline(shapes)
    read_gbs = max(read_gbs, measure_read_bandwidth())
    for row in sweep_rows:
        # The step cannot beat its matmuls at the roofline plus one read of its KV at the streaming
        # read bandwidth (both measured in this run): the roofline counts only the first.
        row["bound_tokens_per_s"] = row["batch"] / (row["batch"] / roofline_tokens_per_s(max(gflops, gflops_end), num_params)
                                                    + row["kv_read_mb"] * 1e6 / (read_gbs * 1e9))
        row["pct_bound"] = 100 * row["tokens_per_s"] / row["bound_tokens_per_s"]
    if gflops_end > gflops:
        gflops, mm_results = gflops_end, mm_end
        roof = roofline_tokens_per_s(gflops, num_params)
        for row in sweep_rows:  # re-express the sweep against the better roofline
            row["pct_roofline"] = 100 * row["tokens_per_s"] / roof
            row["linear_only_pct_roofline"] = 100 * row["linear_only_tokens_per_s"] / roof

    # ------------------------------------------------------------------ report
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
        f"roofline: best fp32 matmul (torch.mm or prepacked oneDNN) {gflops:.1f} GFLOP/s ({', '.join(f'{m}x{k}x{n}: {x.gflops:.0f}' for m, k, n, x in ((r.m, r.k, r.n, r) for r in mm_results))}); "
        f"{num_params / 1e6:.1f} M params/token -> {roof:.1f} tok/s (best at start {gflops_start:.1f}, at end {gflops_end:.1f} GFLOP/s)",
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
                     f"bound: matmuls at the roofline + one read of the step's KV at {read_gbs:.1f} GB/s (streaming "
                     "read, measured in this run); attention reads every cached token of every sequence each step, "
                     "which the matmul roofline leaves out",
                     f"decode attention: {'compiled CPU kernel (paged, one read of the cache)' if engine.runner.paged_decode else 'gather + SDPA'}",
                     "KV: the cache's element type (auto = the model's fp32); narrower rounds K and V when stored, "
                     "the math stays fp32"])
    total_s = time.perf_counter() - t_start
    print(f"total benchmark time {total_s:.0f} s")

    report = {
        "machine": machine_info(), "args": vars(args), "read_bandwidth_gbs": read_gbs, "roofline": {
            "gflops": gflops, "gflops_start": gflops_start, "gflops_end": gflops_end, "params_per_token": num_params, "tokens_per_s": roof,
            "matmuls": [{"m": r.m, "k": r.k, "n": r.n, "gflops": r.gflops, "mm_gflops": r.mm_gflops,
                         "onednn_gflops": r.onednn_gflops} for r in mm_results]},
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
    if args.json:
        write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
