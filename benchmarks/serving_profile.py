"""Where the serving path spends the machine: core-milliseconds per output token, by component.

Starts a server (the engine alone behind the HTTP app in this process, or the Ray Serve app
colocated / disaggregated, through Serve's proxy or with direct ingress), sends a burst with the
load generator in a separate process, and reads every process's and thread's CPU time from
/proc/<pid>/task/<tid>/stat before and after the burst. With `--py-spy`, py-spy samples the
workers' step loops and the ingress, and each thread's CPU time is split by what its samples were
doing (forward pass, sampling, the Python around the step, per-step Ray calls, detokenization, ...).
An idle window before the burst measures what the control loops cost when nothing is served.

    .venv/bin/python benchmarks/serving_profile.py [--setups engine,colocated-direct,colocated-proxy,disagg-direct]
        [--num-prompts 32] [--py-spy] [--result-json PATH] [--dtype float32|bfloat16]

Rows are components; columns are setups; each cell is core-ms of CPU per output token during the
burst (the sum of a column, less the client, is what the server spent per token). Run it holding
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
from collections import defaultdict
from pathlib import Path
from typing import Iterator, NamedTuple

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
PY_SPY = Path(sys.executable).with_name("py-spy")

# (substring of a process's command line, role); the first match wins.
ROLES = [("ray::DecodeWorker", "decode worker"), ("ray::PrefillWorker", "prefill worker"),
         ("ray::StreamHub", "stream hub"), ("ray::Router", "router"),
         ("ServeReplica:pdserve:OpenAIIngress", "ingress (HTTP, SSE, detokenize)"),
         ("ray::ProxyActor", "Serve proxy"), ("ray::ServeController", "Serve controller"),
         ("ray::IDLE", "Ray idle workers"), ("py-spy", "profiler (py-spy)"),
         ("serving_profile_client", "client (load generator)")]
SYSTEM = "Ray system"
DRIVER = "driver (this script)"
ENGINE_ALONE = "engine alone (uvicorn + engine thread)"


class ThreadCPU(NamedTuple):
    comm: str
    cpu_s: float


class ProcCPU(NamedTuple):
    role: str
    threads: dict[int, ThreadCPU]


def _stat_cpu(path: str) -> tuple[str, float] | None:
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    comm = text[text.index("(") + 1:text.rindex(")")]
    fields = text[text.rindex(")") + 2:].split()
    return comm, (int(fields[11]) + int(fields[12])) * TICK_S  # utime + stime


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = defaultdict(list)
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids[ppid].append(int(d))
    return kids


def role_of(pid: int, me: int) -> str:
    if pid == me:
        return DRIVER
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return SYSTEM
    role = next((role for pat, role in ROLES if pat in cmd), None)
    if role:
        return role
    # Ray's own processes by name: raylet, gcs_server, the agents (python .../agent.py), log monitor.
    words = [w for w in cmd.split() if not w.startswith("-")]
    name = next((Path(w).stem for w in words[1:] if w.endswith(".py")), Path(words[0]).name if words else "?")
    return f"{SYSTEM}: {name}"


def snapshot() -> dict[int, ProcCPU]:
    """CPU time of this process and all its descendants (Ray's processes are), per thread."""
    me, kids = os.getpid(), _children()
    out, todo = {}, [me]
    while todo:
        pid = todo.pop()
        todo.extend(kids.get(pid, ()))
        threads = {}
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                st = _stat_cpu(f"/proc/{pid}/task/{tid}/stat")
                if st:
                    threads[int(tid)] = ThreadCPU(*st)
        out[pid] = ProcCPU(role_of(pid, me), threads)
    return out


def diff(before: dict[int, ProcCPU], after: dict[int, ProcCPU]) -> dict[int, ProcCPU]:
    """CPU seconds spent between two snapshots, per process and thread (a thread that ended in between
    is lost: the burst's processes and threads all live through it)."""
    out = {}
    for pid, p in after.items():
        old = before.get(pid, ProcCPU(p.role, {})).threads
        out[pid] = ProcCPU(p.role, {tid: ThreadCPU(t.comm, t.cpu_s - old.get(tid, ThreadCPU("", 0.0)).cpu_s)
                                    for tid, t in p.threads.items()})
    return out


# ------------------------------------------------------------------------------------------ py-spy
def python_threads(pid: int) -> dict[int, str]:
    """{tid: Python thread name} of `pid` (py-spy dump); {} without py-spy."""
    if not PY_SPY.exists():
        return {}
    try:
        text = subprocess.run([str(PY_SPY), "dump", "--pid", str(pid), "--nonblocking"], capture_output=True,
                              text=True, timeout=30).stdout
    except (subprocess.TimeoutExpired, OSError):
        return {}
    names = {}
    for line in text.splitlines():
        if line.startswith("Thread "):
            head, _, name = line.partition(": ")
            with contextlib.suppress(ValueError):
                names[int(head.split()[1], 0)] = name.strip().strip('"')
    return names


# (frame substring, category), the first match along the whole stack wins.
STACK_CATEGORIES = [("model_runner.py", "engine forward"), ("sampler.py", "engine sampling"),
                    ("llm_engine.py", "engine Python around the forward"),
                    ("scheduler.py", "engine Python around the forward"),
                    ("metrics.py", "metrics"), ("_after_step", "per-step reports + token pushes (Ray calls)"),
                    ("_push", "per-step reports + token pushes (Ray calls)"),
                    ("_fan_out", "per-step reports + token pushes (Ray calls)"),
                    ("text_stream.py", "detokenize + stop strings"),
                    ("http_stream.py", "SSE chunks (pydantic, JSON)"),
                    ("router_client.py", "token receipt from the hub (Ray calls)"),
                    ("_idle", "idle loop"), ("_loop", "idle loop"), ("_run", "idle loop")]


def classify(stack: str) -> str:
    for pat, cat in STACK_CATEGORIES:
        if pat in stack:
            return cat
    return "other Python (Ray, Serve, asyncio, HTTP server)"


def read_spy(path: Path) -> dict[int, dict[str, int]]:
    """py-spy raw output (`--threads`): {tid: {category: samples}}."""
    out: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack.startswith("thread (") or not count.isdigit():
            continue
        tid = int(stack[len("thread ("):stack.index(")")], 0)
        out[tid][classify(stack)] += int(count)
    return out


@contextlib.contextmanager
def spying(pids: list[int], folder: Path, rate: int) -> Iterator[dict[int, Path]]:
    """py-spy record on each of `pids` for the with-block; yields {pid: its raw output file}."""
    procs, files = [], {}
    for pid in pids:
        files[pid] = folder / f"spy-{pid}.txt"
        procs.append(subprocess.Popen([str(PY_SPY), "record", "--pid", str(pid), "--rate", str(rate), "--format",
                                       "raw", "--threads", "--nonblocking", "-o", str(files[pid])],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    try:
        yield files
    finally:
        for p in procs:
            p.send_signal(signal.SIGINT)  # py-spy writes its file on Ctrl-C
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


# ------------------------------------------------------------------------------------------ accounting
WORKERS = ("decode worker", "prefill worker", ENGINE_ALONE)
SPLIT = (*WORKERS, "ingress (HTTP, SSE, detokenize)")
LOOP_THREADS = ("-loop", "pdserve-engine")


def _thread_row(role: str, main_comm: str, t: ThreadCPU, pyname: str | None) -> str:
    """The component a thread's CPU time counts for, before any py-spy split."""
    if pyname is None:  # not a Python thread
        # NOTE: torch's OpenMP threads carry the process's name (Ray's worker title); Ray's and gRPC's
        # own threads name themselves (worker.io, grpc_global_tim, ...).
        if role in WORKERS and (t.comm == main_comm or t.comm.startswith("ray::")):
            return "engine forward (intra-op threads)"
        return f"{role}: Ray core (C++ threads)" if role != ENGINE_ALONE else f"{role}: other native threads"
    if role in WORKERS and pyname.endswith(LOOP_THREADS):
        return f"{role}: step loop"
    return f"{role}: Python threads"


def account(delta: dict[int, ProcCPU], pynames: dict[int, dict[int, str]],
            spy: dict[int, dict[int, dict[str, int]]]) -> dict[str, float]:
    """{component: CPU seconds}. A Python thread with py-spy samples is split by what they did."""
    rows: dict[str, float] = defaultdict(float)
    for pid, p in delta.items():
        if p.role not in SPLIT:
            rows[p.role] += sum(t.cpu_s for t in p.threads.values())
            continue
        main_comm = p.threads.get(pid, ThreadCPU("", 0.0)).comm
        for tid, t in p.threads.items():
            row = _thread_row(p.role, main_comm, t, pynames.get(pid, {}).get(tid))
            samples = spy.get(pid, {}).get(tid)
            if not samples or not row.endswith(("step loop", "Python threads")):
                rows[row] += t.cpu_s
                continue
            total = sum(samples.values())
            for cat, n in samples.items():
                name = cat if cat.startswith("engine ") else f"{row}: {cat}"
                rows[name] += t.cpu_s * n / total
    return dict(rows)


# ------------------------------------------------------------------------------------------ runs
CLIENT = ("# serving_profile_client\nimport json, sys\nsys.path.insert(0, sys.argv[1])\n"
          "from deployments.bench_cli import BenchConfig, run_benchmark\n"
          "cfg = json.loads(sys.argv[2])\n"
          "cfg.update(input_len_range=tuple(cfg['input_len_range']), output_len_range=tuple(cfg['output_len_range']))\n"
          "m = run_benchmark(BenchConfig(**cfg))['metrics']\n"
          "open(sys.argv[3], 'w').write(json.dumps(m))\n")

SETUPS = ("engine", "colocated-direct", "colocated-proxy", "disagg-direct", "disagg-proxy")


def server(setup: str, threads: int, dtype: str = "float32") -> contextlib.AbstractContextManager[str]:
    """The server of `setup` on `threads` cores computing in `dtype`; yields its base URL."""
    from benchmarks.common import engine_http_server, serve_app
    from engine import EngineConfig

    if setup == "engine":
        return engine_http_server(EngineConfig(model=None, num_threads=threads, dtype=dtype))
    layout, ingress = setup.split("-")
    if layout == "colocated":
        args = {"num_prefill_workers": 0, "num_decode_workers": 1, "threads_per_worker": threads,
                "worker_num_cpus": threads}
    else:  # the cores split between the pools, one worker each
        half = max(1, threads // 2)
        args = {"num_prefill_workers": 1, "num_decode_workers": 1, "threads_per_worker": half, "worker_num_cpus": half}
    args["dtype"] = dtype
    return serve_app(args, num_cpus=threads, direct=ingress == "direct")


def _timeline(client: subprocess.Popen, timeout_s: float, every_s: float = 0.5) -> list[dict[str, float]]:
    """Until the client exits: cores each role kept busy in each `every_s` interval."""
    out, prev, deadline = [], snapshot(), time.monotonic() + timeout_s
    while client.poll() is None:
        if time.monotonic() > deadline:
            client.kill()
            raise TimeoutError("the load generator did not finish")
        time.sleep(every_s)
        cur = snapshot()
        busy: dict[str, float] = defaultdict(float)
        for p in diff(prev, cur).values():
            busy[p.role] += sum(t.cpu_s for t in p.threads.values()) / every_s
        out.append({k: round(v, 3) for k, v in busy.items() if v >= 0.01})
        prev = cur
    return out


def profile(setup: str, args: argparse.Namespace, folder: Path) -> dict:
    """One setup: warm up, an idle window, then the burst; CPU seconds by component for both."""
    from deployments.bench_cli import BenchConfig, run_benchmark

    load = dict(model="SmolLM2-135M-Instruct", num_prompts=args.num_prompts, request_rate=float("inf"),
                max_concurrency=args.max_concurrency, input_len_range=tuple(args.input_len_range),
                output_len_range=tuple(args.output_len_range), vocab_size=49152, seed=args.seed,
                timeout_s=args.timeout_s, progress=False)
    with server(setup, args.threads, args.dtype) as url:
        run_benchmark(BenchConfig(**{**load, "num_prompts": 4, "input_len_range": (32, 64),
                                     "output_len_range": (8, 8), "max_concurrency": None}, base_url=url))
        s0 = snapshot()
        time.sleep(args.idle_s)
        idle = diff(s0, snapshot())
        out = folder / f"{setup}-metrics.json"
        before = snapshot()
        roles = {pid: p.role for pid, p in before.items()}
        client = subprocess.Popen([sys.executable, "-c", CLIENT, str(ROOT), json.dumps({**load, "base_url": url}),
                                   str(out)])
        targets = [pid for pid, r in roles.items() if r in SPLIT or (setup == "engine" and r == DRIVER)]
        spy_ctx = spying(targets, folder, args.spy_rate) if args.py_spy else contextlib.nullcontext({})
        with spy_ctx as files:
            timeline = _timeline(client, args.timeout_s + 120)
            burst = diff(before, snapshot())
        pynames = {pid: python_threads(pid) for pid in targets}
    metrics = json.loads(out.read_text())
    spy = {pid: read_spy(f) for pid, f in files.items()}
    if setup == "engine":  # this process is the server
        for d in (idle, burst):
            for pid, p in list(d.items()):
                if p.role == DRIVER:
                    d[pid] = p._replace(role=ENGINE_ALONE)
    rows = account(burst, pynames, spy)
    idle_by_role: dict[str, float] = defaultdict(float)
    for pid, p in idle.items():
        idle_by_role[p.role] += sum(t.cpu_s for t in p.threads.values())
    comms: dict[str, float] = defaultdict(float)
    for p in burst.values():
        for t in p.threads.values():
            comms[f"{p.role} / {t.comm}"] += t.cpu_s
    return {"metrics": metrics, "cpu_s": rows, "timeline": timeline, "by_comm": comms, "idle_core_pct": {k: 100 * v / args.idle_s for k, v in
                                                                  idle_by_role.items()}}


# ------------------------------------------------------------------------------------------ report
NOT_SERVER = ("client (load generator)", "profiler (py-spy)", DRIVER)


def report(results: dict[str, dict]) -> None:
    from benchmarks.common import print_table

    setups = list(results)
    per_tok = {s: {k: 1000 * v / max(1, r["metrics"]["total_output_tokens"]) for k, v in r["cpu_s"].items()}
               for s, r in results.items()}
    comps = sorted({k for v in per_tok.values() for k in v}, key=lambda k: -max(v.get(k, 0) for v in per_tok.values()))
    rows = []
    for comp in comps:
        vals = [per_tok[s].get(comp, 0.0) for s in setups]
        if max(vals) >= 0.05:
            rows.append([comp, *(f"{v:.2f}" for v in vals)])
    server = {s: sum(v for k, v in per_tok[s].items() if k not in NOT_SERVER) for s in setups}
    rows.append(["server total (all but client, profiler, driver)", *(f"{server[s]:.2f}" for s in setups)])
    m = {s: results[s]["metrics"] for s in setups}
    rows.append(["output tok/s", *(f"{m[s]['output_throughput']:.1f}" for s in setups)])
    rows.append(["TPOT p50 / TTFT p50 ms", *(f"{m[s]['tpot_ms']['p50']:.0f} / {m[s]['ttft_ms']['p50']:.0f}"
                                            for s in setups)])
    rows.append(["server cores busy (CPU s / wall s)", *(f"{server[s] * m[s]['output_throughput'] / 1000:.2f}"
                                                         for s in setups)])
    print_table("core-ms of CPU per output token, by component (burst)", ["component", *setups], rows)
    idle = sorted({k for r in results.values() for k in r["idle_core_pct"]})
    print_table("idle: % of one core per component, no requests", ["component", *setups],
                [[k, *(f"{results[s]['idle_core_pct'].get(k, 0.0):.1f}" for s in setups)] for k in idle])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setups", default="engine,colocated-direct,colocated-proxy,disagg-direct",
                   help=f"comma-separated, of {', '.join(SETUPS)}")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="cores for the server")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-concurrency", type=int, default=None, help="default: all at once (a burst)")
    p.add_argument("--input-len-range", type=int, nargs=2, default=(64, 256))
    p.add_argument("--output-len-range", type=int, nargs=2, default=(64, 128))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--idle-s", type=float, default=5.0, help="the idle window before the burst")
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--py-spy", action="store_true", help="split threads by py-spy samples (costs some CPU)")
    p.add_argument("--spy-rate", type=int, default=50, help="py-spy samples per second")
    p.add_argument("--result-json", default=None)
    p.add_argument("--dtype", default=None, help="default: what `pdserve serve` picks on this host")
    args = p.parse_args(argv)
    if args.dtype is None:
        from deployments.layouts import local_hardware, pick_dtype
        args.dtype = pick_dtype(local_hardware(), "cpu") or "float32"
    setups = args.setups.split(",")
    if bad := [s for s in setups if s not in SETUPS]:
        p.error(f"unknown setups {bad}; choose from {SETUPS}")
    if args.py_spy and not PY_SPY.exists():
        p.error(f"--py-spy: no {PY_SPY} (.venv/bin/pip install py-spy)")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for setup in setups:
            print(f"=== {setup}", flush=True)
            results[setup] = profile(setup, args, Path(tmp))
    report(results)
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
