"""The cost of the OpenAI API features in the engine, against plain decoding, in one run.

    .venv/bin/python benchmarks/api_features.py [--quick] [--batch-sizes 1,32] [--json out.json]

One process, one engine (SmolLM2-135M fp32 on the CPU, or `--device cuda`), the same threads for every
row. For each batch size B, 2 x B distinct chat prompts (B in --quick) run with `max_num_seqs` = B,
all added at once (finished slots refill), greedy:

  * plain: no extra.
  * top_logprobs=5: `logprobs=5` on every request (raw log_softmax and the top 5 per token).
  * json_schema: every request constrained to a small object schema (xgrammar bitmask per row). Its
    outputs end when the object does, so the rows compare tokens per second, not wall time; every
    output is checked to validate against the schema. The grammar is compiled (and cached) before
    the timed run; the compile time is printed apart.

And n = 4 sampled completions of one prompt (B / 4 prompts of ~300 tokens, so B sequences, B >= 4):

  * n=4 shared: 4 requests per prompt with the same prompt and different seeds, added together: the
    engine computes their common full prompt blocks once (shared prefill through the prefix cache).
  * 4 separate: the same requests with `enable_prefix_caching` off (the documented engine setting),
    so each computes its whole prompt.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jsonschema
import torch

from benchmarks.common import fmt, machine_info, print_table, warm_up, write_json
from benchmarks.speculative import FREE_SUBJECTS, source_texts
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.structured import StructuredSpec

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "description": {"type": "string"},
                   "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "description", "tags"],
    "additionalProperties": False,
}
JSON_INSTRUCTION = " Answer as a JSON object with a name, a description and tags."


@dataclass(slots=True)
class Row:
    feature: str
    batch: int
    requests: int
    output_tokens: int
    prompt_tokens_computed: int
    wall_s: float
    ratio: float | None = None  # tok/s against the row it is compared with

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall_s


def run(engine: LLMEngine, name: str, batch: int, prompts: list[list[int]], params: list[SamplingParams],
        check=None) -> Row:
    """All requests to completion with `max_num_seqs` = batch and an empty prefix cache."""
    cfg = replace(engine.config, max_num_seqs=batch)
    engine.config = engine.scheduler.config = cfg
    engine.block_manager.reset_prefix_cache()
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"{name}-{i}", p, sp)
    out_tokens = computed = 0
    texts = []
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        outs = engine.step()
        out_tokens += sum(len(o.new_token_ids) for o in outs)
        computed += engine.last_step.num_prefill_tokens
        texts += [o.text for o in outs if o.finish_reason == "stop"]  # "length": cut short, not checked
    wall = time.perf_counter() - t0
    engine.check_integrity()
    assert engine.block_manager.num_used_blocks == 0
    if check is not None:
        for text in texts:
            check(text)
        print(f"{name} B={batch}: {len(texts)} of {len(prompts)} outputs complete, all valid", flush=True)
    return Row(name, batch, len(prompts), out_tokens, computed, wall)


def check_json(text: str) -> None:
    jsonschema.validate(json.loads(text), SCHEMA)


def feature_rows(engine: LLMEngine, batch: int, requests: int, max_tokens: int) -> list[Row]:
    # The same prompts for every row: each asks for JSON, so the constrained row is what the model would write.
    chats = [engine.apply_chat_template([{"role": "user", "content": f"Describe {FREE_SUBJECTS[i % len(FREE_SUBJECTS)]} "
                                          f"(#{i})." + JSON_INSTRUCTION}]) for i in range(requests)]
    greedy = dict(max_tokens=max_tokens, temperature=0)
    spec = StructuredSpec("json_schema", json.dumps(SCHEMA))
    t0 = time.perf_counter()
    engine.grammars.compile(spec)
    print(f"json_schema compile: {1e3 * (time.perf_counter() - t0):.1f} ms (cached afterwards)", flush=True)
    plain = run(engine, "plain", batch, chats, [SamplingParams(**greedy, ignore_eos=True)] * requests)
    rows = [plain,
            run(engine, "top_logprobs=5", batch, chats, [SamplingParams(**greedy, ignore_eos=True, logprobs=5)] * requests),
            run(engine, "json_schema", batch, chats, [SamplingParams(**greedy, structured=spec)] * requests,
                check=check_json)]
    for r in rows[1:]:
        r.ratio = r.tok_s / plain.tok_s
    return rows


def fanout_rows(engine: LLMEngine, batch: int, max_tokens: int) -> list[Row]:
    texts = source_texts(900, 1400)
    n_prompts = max(1, batch // 4)
    prompts = [engine.apply_chat_template([{"role": "user", "content": "Summarize:\n\n" + texts[i % len(texts)]}])
               for i in range(n_prompts)]
    prompts = [p[:300] if len(p) >= 300 else p for p in prompts]
    fan = [p for p in prompts for _ in range(4)]
    params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i % 4, ignore_eos=True) for i in range(len(fan))]
    shared = run(engine, "n=4 shared", batch, fan, params)
    cfg = engine.config
    engine.config = engine.scheduler.config = replace(cfg, enable_prefix_caching=False)
    try:
        separate = run(engine, "4 separate", batch, fan, params)
    finally:
        engine.config = engine.scheduler.config = cfg
    separate.ratio = 1.0
    shared.ratio = shared.tok_s / separate.tok_s
    return [separate, shared]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF dir / hub id; default: embedded SmolLM2-135M-Instruct")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--quick", action="store_true", help="B requests per batch size (not 2 x B), 32 tokens each")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.quick:
        args.max_tokens = 32
    torch.set_num_threads(args.threads)
    engine = LLMEngine(EngineConfig(model=args.model, device=args.device, num_threads=args.threads,
                                    max_num_batched_tokens=2048, kv_cache_memory_mb=2048))
    warm_up(engine)
    rows: list[Row] = []
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        requests = batch if args.quick else 2 * batch
        rows += feature_rows(engine, batch, max(requests, 2), args.max_tokens)
        rows += fanout_rows(engine, max(batch, 4), args.max_tokens)
        for r in rows[-5:]:
            print(f"B={r.batch} {r.feature}: {r.tok_s:.1f} tok/s ({r.output_tokens} tokens, {r.wall_s:.2f} s, "
                  f"{r.prompt_tokens_computed} prompt tokens computed)", flush=True)
    table = [[r.feature, r.batch, r.requests, r.output_tokens, r.prompt_tokens_computed, fmt(r.wall_s, 2),
              fmt(r.tok_s), "-" if r.ratio is None else f"{r.ratio:.2f}x"] for r in rows]
    print_table(f"API features vs plain decoding, {args.max_tokens} tokens per request ({args.device}, "
                f"{args.threads} threads)",
                ["feature", "batch", "requests", "out tokens", "prompt tok computed", "wall s", "tok/s", "ratio"],
                table, notes=["ratio: tok/s against plain (features) or against 4 separate (n=4 shared)",
                              "json_schema: greedy, stops when the object is complete; every output validated",
                              "n=4 rows: sampled (temperature 1, seeds 0-3), ~300-token prompts, batch >= 4"])
    if args.json:
        write_json(args.json, {"machine": machine_info(), "args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
