"""engine_throughput.py's decode-only batch sweep: steady decode at fixed batch sizes, beside the time the
same step spends in its linear layers alone, its decode attention alone, and with its per-token ops
as torch ops instead of the fused kernels."""

from __future__ import annotations

import time

import torch

from benchmarks.common import make_workload
from benchmarks.engine_throughput_report import FUSED_AB_PAIRS
from engine import LLMEngine, SamplingParams


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
