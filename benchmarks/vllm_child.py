"""The vLLM side of `vllm_baseline.py`: runs inside a Python that has vLLM's CPU build installed, not
in pdserve's virtualenv (vLLM pins its own torch). Standard library and vLLM only.

Usage: <vllm python> benchmarks/vllm_child.py JOB.json RESULT.json
JOB holds the model directory, the engine limits and the runs (token-id prompts, output lengths); the
result holds each run's wall time and generated token ids.
"""
from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    job_path, result_path = sys.argv[1], sys.argv[2]
    job = json.loads(open(job_path).read())
    # Before vLLM is imported: its CPU worker reads these at start. One process (the engine runs in
    # this one, as pdserve's benchmark does), its OpenMP threads bound to the cores pdserve used.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", job["cpus"])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(job["kv_cache_gib"]))
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(model=job["model_dir"], dtype="float32", max_num_seqs=job["max_num_seqs"],
              max_num_batched_tokens=job["max_num_batched_tokens"], max_model_len=job["max_model_len"],
              enable_prefix_caching=False, seed=0)
    startup_s = time.perf_counter() - t0

    def generate(requests: list[dict]) -> tuple[float, list[list[int]]]:
        prompts = [TokensPrompt(prompt_token_ids=r["prompt"]) for r in requests]
        params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True, detokenize=False)
                  for r in requests]
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t, [list(o.outputs[0].token_ids) for o in outs]

    generate([{"prompt": list(range(100, 140)), "max_tokens": 4}] * 4)  # warm-up, as pdserve's
    runs = []
    for run in job["runs"]:
        wall, tokens = generate(run["requests"])
        runs.append({"name": run["name"], "wall_s": wall, "token_ids": tokens})
        print(f"  vLLM {run['name']}: {wall:.1f} s", flush=True)
    with open(result_path, "w") as f:
        json.dump({"vllm_version": vllm.__version__, "startup_s": startup_s, "runs": runs}, f)


if __name__ == "__main__":
    main()
