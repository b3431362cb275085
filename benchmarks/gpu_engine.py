"""The engine on one GPU: steady decode steps and a burst, on random weights in real models' shapes,
for this tree and (optionally) an older checkout side by side.

    python benchmarks/gpu_engine.py [--shapes smollm2-135m llama3-8b-8layers] [--batches 1 32 64 256]
                                    [--old-tree DIR | --old-commit SHA] [--json PATH] [--budget-s 300]
    python benchmarks/gpu_engine.py --device cpu --shapes tiny --batches 1 2      (a CPU smoke run)

Decode table, per (shape, batch): `batch` requests of 128 random prompt tokens (greedy, ignore_eos,
prefix caching off) are stepped past their prefill and `--warm-steps` more, then
  * decode step wall ms: wall time of `--steps` `LLMEngine.step()` calls / steps (synchronized before
    and after, not between: an engine that overlaps steps keeps its overlap);
  * GPU busy ms in it: per step, the union of the device kernels' intervals in a torch.profiler trace of
    `--profile-steps` steps (overlapping kernels count once; memcpy/memset apart, in the JSON). On a
    CPU: the union of the aten ops' intervals (not the C kernels called through ctypes, nor Python);
  * kernel launches: per step, CPU-side launch calls made inside the steps (cudaLaunchKernel(ExC),
    cuLaunchKernel(Ex), cudaGraphLaunch); kernels run: device kernels per step (a graph launch runs many);
    cudaMemcpyAsync apart (JSON);
  * host syncs: warnings of one step under `torch.cuda.set_sync_debug_mode("warn")` (where: JSON
    `sync_sites`); sync API calls: cudaStreamSynchronize / cudaDeviceSynchronize / cudaEventSynchronize
    made inside the steps (not the harness's own synchronize);
  * output tok/s: batch / decode step wall.
Burst, per shape: `--burst-requests` requests (prompts uniform over `--burst-prompt`, outputs over
`--burst-output`, seeded) added at once and stepped to completion: output tokens / wall, mean step ms
(after an untimed warm-up that meets every decode batch size once). Baselines, in this tree's process
only: transformers' continuous batching on the same burst (its own defaults, which it reports in the
JSON's `ran_with`), and its `generate` with a static cache at batch 1 (ms per token over
`--hf-new-tokens`, after an untimed call of the same shapes).
Engine settings: max_num_seqs covers the largest batch and the burst, max_num_batched_tokens
`--max-batched-tokens` (prefills chunk), max_model_len `--max-model-len`, speculation off; the KV pool
from `--gpu-memory-utilization` where EngineConfig has that field (on CUDA), else `--kv-cache-mb`.

`--old-tree DIR` (or `--old-commit SHA`, archived from this checkout's git): this file runs itself with
`--worker` in a subprocess with PYTHONPATH=DIR and cwd DIR, so `engine` there is the old checkout's.
It uses only what old checkouts have too: EngineConfig (fields filtered by name), LLMEngine's
add_request / step / has_unfinished_requests / abort, SamplingParams, and `gpu_shapes.py` beside it.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import gc
import importlib.util
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
if "--worker" not in sys.argv:  # this tree's engine; a worker takes the one PYTHONPATH names
    sys.path.insert(0, str(HERE.parent))

import torch

PROMPT_LEN = 128
LAUNCH_APIS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")
SYNC_APIS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
STEP_MARK = "gpu_engine_bench.step"  # a record_function range around each profiled step
# (flag, argparse kwargs): the measurement's knobs, forwarded as they are to the old tree's worker.
KNOBS: list[tuple[str, dict[str, Any]]] = [
    ("--device", dict(default="cuda")),
    ("--dtype", dict(default=None, help="default: bfloat16 on cuda, float32 on cpu")),
    ("--shapes", dict(nargs="+", default=["smollm2-135m", "llama3-8b-8layers"])),
    ("--batches", dict(nargs="+", type=int, default=[1, 32, 64, 256])),
    ("--steps", dict(type=int, default=20, help="timed decode steps")),
    ("--warm-steps", dict(type=int, default=5)),
    ("--profile-steps", dict(type=int, default=3)),
    ("--max-batched-tokens", dict(type=int, default=8192, help="engine token budget (prefill chunks)")),
    ("--kv-cache-mb", dict(type=int, default=None, help="default: 16384 on cuda, 512 on cpu")),
    ("--gpu-memory-utilization", dict(type=float, default=0.5, help="used where EngineConfig has it")),
    ("--max-model-len", dict(type=int, default=4096)),
    ("--burst-requests", dict(type=int, default=128)),
    ("--burst-prompt", dict(nargs=2, type=int, default=[128, 512])),
    ("--burst-output", dict(nargs=2, type=int, default=[64, 128])),
    ("--seed", dict(type=int, default=0)),
]


def _load_shapes():
    """gpu_shapes.py from beside this file, by path: under --worker `benchmarks` is the old tree's."""
    spec = importlib.util.spec_from_file_location("pdserve_gpu_shapes", HERE / "gpu_shapes.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


shapes = _load_shapes()


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def free_memory(cuda: bool) -> None:
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def engine_config(args) -> tuple[Any, list[str]]:
    """The EngineConfig for all rows of a shape, and the settings this engine's config lacks."""
    from engine import EngineConfig

    names = {f.name for f in dataclasses.fields(EngineConfig)}
    want: dict[str, Any] = dict(
        device=args.device, dtype=args.dtype, max_num_seqs=max(max(args.batches), args.burst_requests),
        max_num_batched_tokens=args.max_batched_tokens, enable_prefix_caching=False,
        max_model_len=args.max_model_len, speculative_method="off")
    if "gpu_memory_utilization" in names and args.device.startswith("cuda"):
        want["gpu_memory_utilization"] = args.gpu_memory_utilization
    else:
        want["kv_cache_memory_mb"] = args.kv_cache_mb
    return EngineConfig(**{k: v for k, v in want.items() if k in names}), sorted(set(want) - names)


# ---------------------------------------------------------------------------------------------- one step


def _union_ms(spans: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) microsecond intervals, in ms."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total / 1e3


def _in_spans(t: float, spans: list[tuple[float, float]], starts: list[float]) -> bool:
    i = bisect.bisect_right(starts, t) - 1
    return i >= 0 and t <= spans[i][1]


def summarize_trace(events, num_steps: int, cuda: bool) -> dict[str, Any]:
    """Per-step figures from a torch.profiler trace of `num_steps` engine steps, each inside a
    `STEP_MARK` range. CPU-side calls count only inside those ranges (the harness's own synchronize
    stays out); device work counts wherever it ran (it may finish after its step's CPU range)."""
    api: Counter[str] = Counter()
    cpu = torch.autograd.DeviceType.CPU
    steps = sorted((e.time_range.start, e.time_range.end) for e in events if e.name == STEP_MARK and e.device_type == cpu)
    assert len(steps) == num_steps, f"{len(steps)} {STEP_MARK} ranges in the trace, {num_steps} steps run"
    starts = [s for s, _ in steps]
    kernels, copies, cpu_ops = [], [], []
    for e in events:
        span = (e.time_range.start, e.time_range.end)
        if e.device_type != cpu:
            # NOTE: a record_function range shows on the device too (from its first kernel to its last,
            # idle gaps included): not a kernel.
            if not (getattr(e, "is_user_annotation", False) or e.name == STEP_MARK):
                (copies if e.name.startswith(("Memcpy", "Memset")) else kernels).append(span)
        elif not _in_spans(span[0], steps, starts):
            continue
        elif e.name.startswith("cu"):
            api[re.sub(r"_v\d+$", "", e.name)] += 1
        elif e.name.startswith("aten::"):
            cpu_ops.append(span)
    return {"busy_ms": _union_ms(kernels if cuda else cpu_ops) / num_steps,
            "busy_kind": "cuda kernels" if cuda else "cpu aten ops",
            "kernel_launches": sum(api[n] for n in LAUNCH_APIS) / num_steps,
            "graph_launches": api["cudaGraphLaunch"] / num_steps,
            "memcpy_async": api["cudaMemcpyAsync"] / num_steps,
            "sync_api_calls": sum(api[n] for n in SYNC_APIS) / num_steps,
            "device_kernels": len(kernels) / num_steps, "device_copy_ms": _union_ms(copies) / num_steps,
            "runtime_api_per_step": {k: v / num_steps for k, v in api.most_common(12)}}


def profile_steps(engine, num_steps: int, cuda: bool) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    _sync(cuda)
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(num_steps):
            with record_function(STEP_MARK):
                engine.step()
        _sync(cuda)
        wall = time.perf_counter() - t0
    return {"profiled_wall_ms": 1e3 * wall / num_steps, **summarize_trace(prof.events(), num_steps, cuda)}


def host_syncs(engine) -> tuple[int, list[str]]:
    """Synchronizing CUDA calls in one step, and where in Python they were made."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    return len(syncs), sorted({f"{Path(w.filename).name}:{w.lineno}" for w in syncs})


def _end_requests(engine, request_ids: list[str]) -> None:
    abort = getattr(engine, "abort", None)
    for rid in request_ids if abort else []:
        abort(rid)
    while engine.has_unfinished_requests():  # without abort: their max_tokens ends them
        engine.step()


def measure_decode(engine, batch: int, vocab: int, args, cuda: bool) -> dict[str, Any]:
    """One row of the decode table (module docstring)."""
    from engine import SamplingParams

    rng = random.Random(args.seed * 1000 + batch)
    # NOTE: a request that finished its prefill early decodes while the others prefill: room for that.
    max_tokens = (args.warm_steps + args.steps + args.profile_steps + 1
                  + math.ceil(batch * PROMPT_LEN / args.max_batched_tokens) + 16)
    rids = [f"decode-{batch}-{i}" for i in range(batch)]
    try:
        for rid in rids:
            engine.add_request(rid, [rng.randrange(100, vocab) for _ in range(PROMPT_LEN)],
                               SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        started: set[str] = set()
        steps_to_decode = 0
        while len(started) < batch:  # a request's first output comes with the end of its prefill
            started.update(out.request_id for out in engine.step())
            steps_to_decode += 1
            assert steps_to_decode < max_tokens, f"{batch - len(started)} requests never started decoding"
        for _ in range(args.warm_steps):
            engine.step()
        _sync(cuda)
        times, fewest_outputs = [], batch
        t0 = time.perf_counter()
        for _ in range(args.steps):
            ts = time.perf_counter()
            fewest_outputs = min(fewest_outputs, len(engine.step()))
            times.append(time.perf_counter() - ts)
        _sync(cuda)
        wall = (time.perf_counter() - t0) / args.steps
        syncs, sites = host_syncs(engine) if cuda else (None, [])
        row = {"batch": batch, "step_wall_ms": 1e3 * wall, "step_wall_ms_median": 1e3 * sorted(times)[len(times) // 2],
               "output_tok_s": batch / wall, "host_syncs": syncs, "sync_sites": sites,
               "steps_to_decode": steps_to_decode, "full_batch": fewest_outputs == batch}
        row.update(profile_steps(engine, args.profile_steps, cuda))
        return row
    finally:
        _end_requests(engine, rids)


def run_burst(engine, burst: list[tuple[list[int], int]], cuda: bool) -> dict[str, Any]:
    """All of `burst` added at once, stepped to completion (after an untimed warm-up)."""
    from engine import SamplingParams

    # NOTE: the warm-up's decode batch shrinks by one each step, from len(burst) down to 1: every batch
    # size the burst will meet has run once (an engine that captures a CUDA graph per size does it here).
    for i, (prompt, _) in enumerate(burst):
        engine.add_request(f"warm-{i}", prompt[:16], SamplingParams(max_tokens=i + 1, temperature=0, ignore_eos=True))
    _end_requests(engine, [])
    _sync(cuda)
    made: dict[str, int] = {}
    steps, step_s = 0, 0.0
    t0 = time.perf_counter()
    for i, (prompt, n) in enumerate(burst):
        engine.add_request(f"burst-{i}", prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    while engine.has_unfinished_requests():
        ts = time.perf_counter()
        outs = engine.step()
        step_s += time.perf_counter() - ts
        steps += 1
        made.update((o.request_id, len(o.token_ids)) for o in outs if o.finished)
    _sync(cuda)
    wall = time.perf_counter() - t0
    requested = sum(n for _, n in burst)
    return {"requests": len(burst), "output_tokens": sum(made.values()), "requested_tokens": requested,
            "complete": sum(made.values()) == requested, "wall_s": wall,
            "output_tok_s": sum(made.values()) / wall, "steps": steps, "mean_step_ms": 1e3 * step_s / steps}


# ---------------------------------------------------------------------------------------------- one tree


@dataclasses.dataclass
class Run:
    """One tree's measurement under way: its report, the run's deadline, and how the report is saved."""

    report: dict[str, Any]
    deadline: float
    checkpoint: Callable[[], None]

    def section(self, name: str, fn: Callable[[], None]) -> None:
        """Run one part: skipped past the deadline, its error recorded (the rest still runs); then save
        the report so far, so a run killed later still leaves it."""
        if time.monotonic() > self.deadline:
            self.report["skipped"].append(name)
            print(f"[skip] {name}: --budget-s spent", flush=True)
            return
        t0 = time.monotonic()
        try:
            fn()
            print(f"[done] {name} ({time.monotonic() - t0:.1f} s)", flush=True)
        except Exception as exc:  # noqa: BLE001 - recorded; the next part still runs
            traceback.print_exc()
            self.report["errors"].append({"section": name, "error": f"{type(exc).__name__}: {exc}"[:2000]})
            print(f"[error] {name}: {exc!r}", flush=True)
        self.checkpoint()


def measure_tree(args, tokenizer, run: Run, baselines: bool) -> None:
    """Every row for the `engine` this process imports (this tree's, or the old one's under --worker)."""
    cuda = torch.device(args.device).type == "cuda"
    report = run.report
    report.update({"engine_path": None, "decode": [], "burst": [], "baselines": [], "errors": [], "skipped": [],
                   "shapes": {}})
    engine_pkg = None

    def import_engine():
        nonlocal engine_pkg
        import engine as engine_pkg

        report["engine_path"] = str(Path(engine_pkg.__file__).resolve().parent)

    run.section("import engine", import_engine)
    for shape in args.shapes if engine_pkg else []:
        held: dict[str, Any] = {}

        def build(shape=shape, held=held):
            held["model"] = shapes.build_model(shape, tokenizer, args.device, getattr(torch, args.dtype), args.seed)
            report["shapes"][shape] = shapes.shape_summary(held["model"])
            config, report["config_fields_missing"] = engine_config(args)
            with shapes.engine_uses(held["model"], tokenizer, shape):
                held["engine"] = engine_pkg.LLMEngine(config)

        run.section(f"{shape}: build", build)
        if "engine" in held:
            vocab = held["model"].config.vocab_size
            for batch in args.batches:
                run.section(f"{shape}: decode batch {batch}", lambda b=batch: report["decode"].append(
                    {"shape": shape, **measure_decode(held["engine"], b, vocab, args, cuda)}))
            run.section(f"{shape}: burst", lambda: report["burst"].append(
                {"shape": shape, **run_burst(held["engine"], burst_of(args, vocab), cuda)}))
        held.clear()
        free_memory(cuda)
    # NOTE: the baselines go last (a model rebuilt from the same seed is the same model): transformers'
    # compilation and graph capture take minutes, and the budget is for the engine's rows first.
    for shape in args.shapes if baselines else []:
        held = {}
        run.section(f"{shape}: rebuild for transformers", lambda shape=shape, held=held: held.update(
            model=shapes.build_model(shape, tokenizer, args.device, getattr(torch, args.dtype), args.seed)))
        if "model" in held:
            run_baselines(run, shape, held["model"], tokenizer, burst_of(args, held["model"].config.vocab_size), args)
        held.clear()
        free_memory(cuda)


def burst_of(args, vocab: int) -> list[tuple[list[int], int]]:
    return shapes.make_burst(args.burst_requests, tuple(args.burst_prompt), tuple(args.burst_output), vocab, args.seed)


def run_baselines(run: Run, shape: str, model, tokenizer, burst, args) -> None:
    pad, rows = tokenizer.eos_token_id, run.report["baselines"]
    max_seqs = max(max(args.batches), args.burst_requests)
    run.section(f"{shape}: HF continuous batching", lambda: rows.append(
        {"shape": shape, **shapes.hf_continuous_burst(model, burst, max_seqs, args.max_batched_tokens, pad)}))
    free_memory(torch.device(args.device).type == "cuda")
    run.section(f"{shape}: HF static-cache generate", lambda: rows.append(
        {"shape": shape, **shapes.hf_static_generate(model, burst[0][0][:32], args.hf_new_tokens, pad)}))
    free_memory(torch.device(args.device).type == "cuda")


# ---------------------------------------------------------------------------------------------- old tree


def archive_commit(sha: str) -> Path:
    """`git archive SHA` of this checkout, unpacked into a new temporary directory."""
    root = HERE.parent
    if not (root / ".git").exists():
        raise SystemExit(f"--old-commit needs this checkout's git ({root}/.git is missing): pass --old-tree DIR")
    out = Path(tempfile.mkdtemp(prefix=f"pdserve-{sha[:12]}-"))
    archive = subprocess.run(["git", "-C", str(root), "archive", sha], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out


def knob_argv(args) -> list[str]:
    argv: list[str] = []
    for flag, _ in KNOBS:
        value = getattr(args, flag[2:].replace("-", "_"))
        argv += [flag, *map(str, value)] if isinstance(value, list) else [flag, str(value)]
    return argv


def run_old_tree(args, old_dir: Path, tokenizer_dir: str, budget_s: float) -> dict[str, Any]:
    """The engine rows of the checkout in `old_dir`, from this file re-run there as a worker."""
    if not (old_dir / "engine" / "__init__.py").exists():
        return {"error": f"--old-tree {old_dir}: no engine/__init__.py there"}
    report = Path(tempfile.mkdtemp(prefix="gpu_engine_old_")) / "old.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--json", str(report),
           "--budget-s", f"{budget_s:.0f}", *knob_argv(args)]
    path = os.pathsep.join(p for p in (str(old_dir), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path, **{shapes.TOKENIZER_ENV: tokenizer_dir})
    print(f"== old tree {old_dir}: {' '.join(cmd[1:])}", flush=True)
    try:
        failure = None
        proc = subprocess.run(cmd, cwd=old_dir, env=env, timeout=budget_s + args.worker_grace_s)
        if proc.returncode:
            failure = f"the old tree's worker exited with {proc.returncode}"
    except subprocess.TimeoutExpired:
        failure = f"the old tree's worker ran past {budget_s + args.worker_grace_s:.0f} s and was killed"
    if not report.exists():  # it saves its report after every part: what it finished is there
        return {"error": f"{failure or 'the old worker'}: no report"}
    return {**json.loads(report.read_text()), **({"error": failure} if failure else {})}


# ---------------------------------------------------------------------------------------------- output

DECODE_COLUMNS = [("decode step wall ms", "step_wall_ms", 2), ("GPU busy ms in it", "busy_ms", 2),
                  ("kernel launches", "kernel_launches", 0), ("kernels run", "device_kernels", 0),
                  ("host syncs", "host_syncs", 0),
                  ("sync API calls", "sync_api_calls", 0), ("output tok/s", "output_tok_s", 0)]
BURST_COLUMNS = [("requests", "requests", 0), ("output tokens", "output_tokens", 0), ("wall s", "wall_s", 2),
                 ("output tok/s", "output_tok_s", 0), ("mean step ms", "mean_step_ms", 2), ("steps", "steps", 0)]


def _fmt(x: Any, digits: int) -> str:
    return "-" if not isinstance(x, (int, float)) or isinstance(x, bool) else f"{x:,.{digits}f}"


def _ratio(new: Any, old: Any) -> str:
    ok = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (new, old))
    return f"{new / old:.2f}x" if ok and old else "-"


def _md(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _side_by_side(key_names: list[str], columns, new_rows: list[dict], old_rows: list[dict] | None,
                  key: Callable[[dict], tuple]) -> str:
    """One table: per key, the old row, the new row and new/old (or only the new rows)."""
    old_by_key = {key(r): r for r in old_rows or []}
    header = key_names + (["tree"] if old_rows is not None else []) + [c[0] for c in columns]
    rows = []
    for r in new_rows:
        k = [str(v) for v in key(r)]
        if old_rows is None:
            rows.append(k + [_fmt(r.get(f), d) for _, f, d in columns])
            continue
        o = old_by_key.get(key(r), {})
        rows.append(k + ["old"] + [_fmt(o.get(f), d) for _, f, d in columns])
        rows.append(k + ["new"] + [_fmt(r.get(f), d) for _, f, d in columns])
        rows.append(k + ["new/old"] + [_ratio(r.get(f), o.get(f)) for _, f, d in columns])
    return _md(header, rows)


def markdown(result: dict[str, Any]) -> str:
    new, old = result["new"], result.get("old")
    old_ok = old is not None and "decode" in old  # a killed worker still has the rows it finished
    parts = [f"## Decode steps ({result['meta']['device_name']}, {result['meta']['dtype']})",
             _side_by_side(["model shapes", "batch"], DECODE_COLUMNS, new["decode"], old["decode"] if old_ok else None,
                           lambda r: (r["shape"], r["batch"])),
             "", "## Burst", _side_by_side(["model shapes"], BURST_COLUMNS, new["burst"], old["burst"] if old_ok else None,
                                           lambda r: (r["shape"],))]
    if new["baselines"]:
        parts += ["", "## transformers baselines (same model)",
                  _md(["model shapes", "baseline", "output tok/s", "ms per token", "wall s", "not counted s"],
                      [[b["shape"], b["name"] + (f", batch {b['batch']}" if "batch" in b else f", {b['requests']} requests"),
                        _fmt(b["output_tok_s"], 0), _fmt(b.get("ms_per_token"), 2), _fmt(b["wall_s"], 2),
                        _fmt(b.get("warmup_s_not_counted", b.get("setup_s_not_counted")), 1)] for b in new["baselines"]])]
    busy = {r["busy_kind"] for r in new["decode"]}
    parts.append(f"\nbusy = union of {', '.join(sorted(busy)) or '-'} intervals; per-step counts are means over the "
                 "profiled steps; new/old < 1 is faster for ms, > 1 is faster for tok/s")
    for name, tree in (("new", new), ("old", old)):
        if tree is None:
            continue
        if "error" in tree:
            parts.append(f"* {name} tree: {tree['error']}")
        for e in tree.get("errors", []):
            parts.append(f"* {name} error in {e['section']}: {e['error'][:300]}")
        if tree.get("skipped"):
            parts.append(f"* {name} skipped (budget): {', '.join(tree['skipped'])}")
    return "\n".join(parts)


# ---------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for flag, kwargs in KNOBS:
        p.add_argument(flag, **kwargs)
    old = p.add_mutually_exclusive_group()
    old.add_argument("--old-tree", type=Path, help="a checkout holding an older engine/ to compare with")
    old.add_argument("--old-commit", help="archive this commit of this checkout as the old tree")
    p.add_argument("--json", default=os.path.join(os.environ["OUT"], "gpu_engine.json") if os.environ.get("OUT") else None)
    p.add_argument("--budget-s", type=float, default=300.0, help="parts still to run after this are skipped")
    p.add_argument("--old-share", type=float, default=0.4, help="fraction of the budget the old tree gets")
    p.add_argument("--worker-grace-s", type=float, default=180.0, help="old worker's time past its budget")
    p.add_argument("--hf-new-tokens", type=int, default=64)
    p.add_argument("--no-baselines", action="store_true")
    p.add_argument("--tokenizer", help=f"a saved tokenizer dir (default ${shapes.TOKENIZER_ENV}, else the default model's)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    cuda = args.device.startswith("cuda")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.kv_cache_mb = args.kv_cache_mb or (16384 if cuda else 512)
    return args


def meta(args) -> dict[str, Any]:
    import transformers

    cuda = args.device.startswith("cuda") and torch.cuda.is_available()
    return {"device_name": torch.cuda.get_device_name() if cuda else "cpu", "dtype": args.dtype,
            "torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
            "argv": sys.argv[1:], "time": time.strftime("%Y-%m-%d %H:%M:%S")}


def save_json(path: str | None, obj: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(obj, indent=1))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    deadline = time.monotonic() + args.budget_s
    tokenizer = shapes.load_tokenizer(args.tokenizer)
    if args.worker:
        report: dict[str, Any] = {"meta": meta(args)}
        measure_tree(args, tokenizer, Run(report, deadline, lambda: save_json(args.json, report)), baselines=False)
        save_json(args.json, report)
        return report
    old = None
    old_dir = args.old_tree.resolve() if args.old_tree else archive_commit(args.old_commit) if args.old_commit else None
    if old_dir is not None:
        tokenizer_dir = args.tokenizer or os.environ.get(shapes.TOKENIZER_ENV)
        if not tokenizer_dir:
            tokenizer_dir = tempfile.mkdtemp(prefix="gpu_engine_tok_")
            tokenizer.save_pretrained(tokenizer_dir)
        try:  # NOTE: absolute: the worker runs in the old tree
            old = run_old_tree(args, old_dir, str(Path(tokenizer_dir).resolve()), args.budget_s * args.old_share)
        finally:
            if args.old_commit:
                shutil.rmtree(old_dir, ignore_errors=True)
        old["tree"] = args.old_commit or str(old_dir)
    result: dict[str, Any] = {"meta": meta(args), "new": {}, "old": old}
    measure_tree(args, tokenizer, Run(result["new"], deadline, lambda: save_json(args.json, result)),
                 baselines=not args.no_baselines)
    save_json(args.json, result)
    print("\n" + markdown(result), flush=True)
    if args.json:
        print(f"\nJSON: {args.json}")
    return result


if __name__ == "__main__":
    main()
