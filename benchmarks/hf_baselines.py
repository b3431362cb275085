"""transformers' own batching on the engine_throughput.py workload: `generate` on left-padded static
batches, and its continuous batching manager with a length per request (the same work as our rows)."""

from __future__ import annotations

import time

import torch

from benchmarks.common import BenchRequest
from benchmarks.engine_throughput_report import RunResult


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
