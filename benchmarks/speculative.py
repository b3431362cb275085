"""Speculative decoding in the engine: off / ngram / suffix at several batch sizes on two workloads.

    .venv/bin/python benchmarks/speculative.py [--quick] [--batch-sizes 1,4,16,64] [--json out.json]

One process, SmolLM2-135M fp32 on the CPU (or `--device cuda`), greedy with ignore_eos:

  * copy: chat prompts that ask the model to repeat or lightly edit a given text (paragraphs of this
    repository's README.md and source files), so much of the output copies the input: where prompt
    lookup and suffix decoding guess well.
  * free: open-ended chat prompts (stories, explanations): little to copy.

For each (workload, batch size B, method) a fresh engine state (new speculator, empty prefix cache)
runs 2 x B requests (at least 3) with `max_num_seqs` = B, all added at once: finished requests' slots
refill, so a sequence that speculation speeds up makes room for the next one (with one request per
slot the slowest sequence alone sets the wall time). One engine serves every run: the method and B
are swapped into its config between runs. Reported: output tok/s
over the whole run (prefill included) and over the decode-only steps, the acceptance rate (accepted
/ drafted) and the mean accepted length (tokens per verifying sequence-step, 1 + accepted drafts).
Greedy outputs are checked equal to speculation off (they must be, token for token).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import COPY_INSTRUCTIONS, fmt, machine_info, print_table, repo_paragraphs, warm_up, write_json
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.spec.speculator import Speculator

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("off", "ngram", "suffix")
# Free generation: every prompt distinct (a template and a subject), so no output repeats another's.
FREE_TEMPLATES = (
    "Write a short story about {}.",
    "Explain {} to a ten-year-old.",
    "Describe the history of {} in detail.",
    "What are the pros and cons of {}? Discuss.",
    "Write a poem about {}.",
    "Give me a detailed plan for learning about {}.",
)
FREE_SUBJECTS = (
    "a lighthouse keeper", "refrigerators", "medieval blacksmiths", "working from home", "autumn leaves",
    "the guitar", "cats", "mountain trips", "volcanoes", "the printing press", "honey bees", "submarines",
    "chess", "bread baking", "the moon landing", "coral reefs", "railways", "glaciers", "jazz", "windmills",
    "paper money", "owls", "the telescope", "desert caravans",
)


def source_texts(min_chars: int = 250, max_chars: int = 700) -> list[str]:
    """Paragraphs of prose (README and docs) and code (the engine) from this repository."""
    return repo_paragraphs(["README.md", "docs", *(str(p.relative_to(ROOT)) for p in sorted((ROOT / "engine").glob("*.py")))],
                           min_chars, max_chars)


def copy_prompts(engine: LLMEngine, n: int, offset: int) -> list[list[int]]:
    texts = source_texts()
    return [engine.apply_chat_template([{"role": "user", "content": COPY_INSTRUCTIONS[i % len(COPY_INSTRUCTIONS)]
                                         .format(text=texts[(offset + i) % len(texts)])}]) for i in range(n)]


def free_prompts(engine: LLMEngine, n: int, offset: int) -> list[list[int]]:
    t, m = len(FREE_TEMPLATES), len(FREE_SUBJECTS)
    return [engine.apply_chat_template([{"role": "user", "content": FREE_TEMPLATES[i % t].format(
        FREE_SUBJECTS[(i // t + offset) % m])}]) for i in range(n)]


@dataclass(slots=True)
class Row:
    workload: str
    batch: int
    method: str
    output_tokens: int
    wall_s: float
    decode_tokens: int  # tokens emitted by steps without prompt tokens
    decode_s: float
    drafted: int
    accepted: int
    acceptance_rate: float
    mean_accepted_length: float
    same_as_off: bool | None

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0


def run_one(engine: LLMEngine, method: str, prompts: list[list[int]], max_tokens: int, batch: int,
            adaptive: bool, num_spec: int) -> tuple[Row, dict[str, list[int]]]:
    """Run `prompts` to completion on `engine` reconfigured for `method` and batch size `batch`."""
    from dataclasses import replace

    cfg = replace(engine.config, speculative_method=method, max_num_seqs=batch, speculative_adaptive=adaptive,
                  num_speculative_tokens=num_spec)
    engine.config = engine.scheduler.config = cfg
    engine.speculator = Speculator(cfg) if method != "off" else None
    engine.block_manager.reset_prefix_cache()
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"{method}-{i}", p, sp)
    results: dict[str, list[int]] = {}
    out_tokens = dec_tokens = 0
    dec_s = 0.0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        outs = engine.step()
        n = sum(len(o.new_token_ids) for o in outs)
        out_tokens += n
        st = engine.last_step
        if st.num_prefill_tokens == 0 and st.num_seqs:
            dec_tokens += n
            dec_s += st.duration_s
        for o in outs:
            if o.finished:
                results[o.request_id.split("-", 1)[1]] = o.token_ids
    wall = time.perf_counter() - t0
    engine.check_integrity()
    assert engine.block_manager.num_used_blocks == 0
    ss = engine.spec_stats()
    row = Row("", batch, method, out_tokens, wall, dec_tokens, dec_s, ss.num_drafted, ss.num_accepted,
              ss.acceptance_rate, ss.mean_accepted_length, None)
    return row, results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF dir / hub id; default: embedded SmolLM2-135M-Instruct")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch-sizes", default="1,4,16,64")
    p.add_argument("--workloads", default="copy,free")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--requests-per-slot", type=float, default=2.0, help="requests = this x batch size (>= 3)")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--no-adaptive", action="store_true", help="always draft num_speculative_tokens")
    p.add_argument("--quick", action="store_true", help="48 tokens per request (all batch sizes still run)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.quick:
        args.max_tokens = 48
    torch.set_num_threads(args.threads)
    engine = LLMEngine(EngineConfig(model=args.model, device=args.device, num_threads=args.threads,
                                    max_num_batched_tokens=2048, kv_cache_memory_mb=2048))
    warm_up(engine)
    makers = {"copy": copy_prompts, "free": free_prompts}
    rows: list[Row] = []
    for wl in args.workloads.split(","):
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            prompts = makers[wl](engine, max(3, int(batch * args.requests_per_slot)), offset=batch)
            base = None
            for method in args.methods.split(","):
                row, res = run_one(engine, method, prompts, args.max_tokens, batch, not args.no_adaptive,
                                   args.num_speculative_tokens)
                row.workload = wl
                if method == "off":
                    base = res
                elif base is not None:
                    row.same_as_off = res == base
                rows.append(row)
                print(f"{wl} B={batch} {method}: {row.tok_s:.1f} tok/s, decode {row.decode_tok_s:.1f} tok/s, "
                      f"accept {row.acceptance_rate:.2f}, len {row.mean_accepted_length:.2f}", flush=True)
    off = {(r.workload, r.batch): r for r in rows if r.method == "off"}
    table = []
    for r in rows:
        ref = off.get((r.workload, r.batch))
        speedup = r.tok_s / ref.tok_s if ref else None
        table.append([r.workload, r.batch, r.method, fmt(r.tok_s), fmt(r.decode_tok_s),
                      fmt(speedup, 2) + "x" if speedup else "-",
                      "-" if r.method == "off" else fmt(r.acceptance_rate, 2),
                      "-" if r.method == "off" else fmt(r.mean_accepted_length, 2),
                      {None: "-", True: "yes", False: "NO"}[r.same_as_off]])
    print_table(f"Speculative decoding, {args.max_tokens} greedy tokens per request ({args.device}, "
                f"{args.threads} threads)",
                ["workload", "batch", "method", "tok/s", "decode tok/s", "vs off", "accept", "mean len", "same"],
                table, notes=["tok/s: output tokens / wall time (prefill included); decode tok/s: steps "
                              "without prompt tokens only", "mean len: tokens per verifying sequence-step"])
    if args.json:
        write_json(args.json, {"machine": machine_info(), "args": vars(args), "rows": rows})
    return 0 if all(r.same_as_off is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
