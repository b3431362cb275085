"""Shared helpers for the benchmarks: the fp32 matmul roofline, workloads, engine runs, servers to
benchmark over HTTP (the engine in this process, or a local Ray Serve app), rich tables, JSON.

The roofline is measured in the same process and with the same thread count as the run it judges, so
a number like "62% of roofline" compares like with like on whatever machine it ran on. Ray, Serve and
uvicorn load only inside the helpers that start them: the engine-only benchmarks never import them.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import platform
import random
import socket
import threading
import time
from dataclasses import asdict, dataclass, is_dataclass, replace
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from deployments.bench_cli import BenchConfig, run_benchmark
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.models import can_prepack

# ---------------------------------------------------------------------------------------------- roofline


@dataclass(frozen=True, slots=True)
class MatmulResult:
    m: int
    k: int
    n: int
    gflops: float  # the better of the two paths below
    mm_gflops: float  # torch.mm, best of the timed repeats
    onednn_gflops: float | None  # oneDNN with the weight prepacked (the engine's CPU matmul), if available


def _best_gflops(fn, flops: float, min_time_s: float, repeats: int) -> float:
    for _ in range(3):  # warm caches and the dispatcher
        fn()
    # Calibrate the loop length so one timed loop lasts about min_time_s.
    t0 = time.perf_counter()
    fn()
    one = max(time.perf_counter() - t0, 1e-6)
    iters = max(1, int(min_time_s / one))
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        best = max(best, flops * iters / (time.perf_counter() - t0) / 1e9)
    return best


def time_matmul(m: int, k: int, n: int, *, min_time_s: float = 0.25, repeats: int = 5,
                dtype: torch.dtype = torch.float32) -> MatmulResult:
    """Best GFLOP/s of `[m, k] @ [k, n]` over `repeats` timed loops of >= `min_time_s` each, through
    torch.mm and through oneDNN with a prepacked weight (what the engine runs on CPU); the roofline
    takes the better, so the engine's own matmul path cannot beat its yardstick by construction."""
    a = torch.randn(m, k, dtype=dtype)
    b = torch.randn(k, n, dtype=dtype)
    flops = 2.0 * m * k * n
    mm = _best_gflops(lambda: torch.mm(a, b), flops, min_time_s, repeats)
    dnn = None
    if can_prepack(a.device, dtype):
        packed = torch.ops.mkldnn._reorder_linear_weight(b.t().contiguous(), None)
        dnn = _best_gflops(lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""),
                           flops, min_time_s, repeats)
    return MatmulResult(m, k, n, max(mm, dnn or 0.0), mm, dnn)


def measure_roofline(shapes: Sequence[tuple[int, int, int]], **kwargs) -> tuple[float, list[MatmulResult]]:
    """fp32 GFLOP/s of the machine: the best over `shapes` (model-like shapes plus a large square one)."""
    results = [time_matmul(m, k, n, **kwargs) for m, k, n in shapes]
    return max(r.gflops for r in results), results


def measure_read_bandwidth(mib: int = 512, repeats: int = 5) -> float:
    """GB/s of a streaming read (`torch.sum` over `mib` MiB of fp32, far beyond any cache), best of
    `repeats`: what decode attention's read of the KV cache can at best run at on this machine."""
    x = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    x.sum()  # touch every page first
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = max(best, x.numel() * 4 / (time.perf_counter() - t0) / 1e9)
    return best


def params_per_token(model: torch.nn.Module) -> int:
    """Weights each generated token multiplies through: every parameter except the input embedding,
    plus the lm_head. A tied embedding is therefore counted once (as the lm_head matmul); an untied
    one counts only its lm_head. Norm weights are included (they are tiny)."""
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if p is embed and p is not head:
            continue
        total += p.numel()
    return total


def roofline_tokens_per_s(gflops: float, num_params: int) -> float:
    """Tokens/s if every token cost exactly 2 * params FLOPs at the measured matmul rate."""
    return gflops * 1e9 / (2.0 * num_params)


# ---------------------------------------------------------------------------------------------- workload


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int


def make_workload(num_requests: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
                  vocab_size: int, seed: int = 0, low_token_id: int = 100) -> list[BenchRequest]:
    """Random-token prompts and output lengths, both uniform over the inclusive ranges.

    Token ids start at `low_token_id` so that no prompt holds special tokens (bos/eos/pad)."""
    rng = random.Random(seed)
    out = []
    for _ in range(num_requests):
        n = rng.randint(*prompt_range)
        prompt = [rng.randrange(low_token_id, vocab_size) for _ in range(n)]
        out.append(BenchRequest(prompt, rng.randint(*output_range)))
    return out


def add_workload_args(p) -> None:
    """The flags of the shared burst workload (`make_workload`) on an argparse parser."""
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--min-prompt", type=int, default=32)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)


# ---------------------------------------------------------------------------------------------- engine runs


def drain(engine: LLMEngine) -> dict[str, list[int]]:
    """Step until every request has finished, as a burst (nothing else is coming); their token ids."""
    done: dict[str, list[int]] = {}
    engine.scheduler.draining = True
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    engine.scheduler.draining = False
    return done


def touch_kv_pool(engine: LLMEngine) -> None:
    """Write every page of the KV cache once. The engine maps its pool lazily (zero pages on first
    write, so a worker starts at once), and a fresh pool pays a page fault for each page a step first
    writes into (~700 faults, ~5 ms of system time in a batch-128 decode step here); a server's pool
    is past that after its first pass through the blocks. Touch it to time that steady state."""
    engine.runner.kv_cache.view(-1).view(torch.uint8)[::4096].zero_()


def warm_up(engine: LLMEngine) -> None:
    """One short mixed run so the first timed step does not pay for lazy allocations."""
    touch_kv_pool(engine)
    for i in range(4):
        engine.add_request(f"warm-{i}", list(range(100, 100 + 40 * (i + 1))),
                           SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    drain(engine)


# ---------------------------------------------------------------------------------------------- servers

MODEL_NAME = "SmolLM2-135M-Instruct"  # what the HTTP benchmarks call the model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_url(cfg: BenchConfig, url: str, warmup: int) -> dict:
    """Warm up (compile paths, caches, KV channels), then the measured run on the same URL."""
    if warmup:
        run_benchmark(BenchConfig(base_url=url, model=cfg.model, num_prompts=warmup, input_len=32, output_len=8,
                                  vocab_size=cfg.vocab_size, seed=cfg.seed + 99, progress=False, timeout_s=300))
    return run_benchmark(replace(cfg, base_url=url))


@contextlib.contextmanager
def engine_http_server(config: EngineConfig, start_timeout_s: float = 30.0, **app_kwargs) -> Iterator[str]:
    """An `LLMEngine` behind the OpenAI HTTP app (`LocalEngineBackend`), served by uvicorn in a thread
    of this process; yields the base URL. `app_kwargs` go to `build_openai_app` (api_key, tenants...). On exit the server and the engine go, and their memory with
    them before the next row starts."""
    import uvicorn

    from deployments.frontend.backend import LocalEngineBackend
    from deployments.frontend.http_app import build_openai_app

    engine = LLMEngine(config)
    backend = LocalEngineBackend(engine)
    app = build_openai_app(backend, engine.tokenizer, MODEL_NAME, engine.max_model_len, **app_kwargs)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # bound before the server starts: no race for the port
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + start_timeout_s
        while not server.started:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the in-process uvicorn server did not start in {start_timeout_s:.0f} s")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        backend.shutdown()
        del engine, backend, app
        gc.collect()


@contextlib.contextmanager
def serve_app(app_args: dict, num_cpus: int, direct: bool = False) -> Iterator[str]:
    """A local Ray with the pdserve app built from `app_args`, started as `pdserve serve` starts them
    (`--direct-ingress` with `direct`); yields the HTTP base URL, then shuts it all down and restores
    this process's environment."""
    import ray
    from ray import serve

    from deployments.app import build_app, shutdown_router
    from deployments.config import ServeConfig, apply_ray_env_defaults, direct_ingress_env

    port = free_port()
    saved_env = dict(os.environ)
    apply_ray_env_defaults()
    proxy_port = port
    if direct:  # the ingress replica serves `port`, the proxy moves
        os.environ.update(direct_ingress_env(port, 2, ServeConfig().ingress_drain_s))
        proxy_port = free_port()
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": proxy_port})
        t0 = time.perf_counter()
        serve.run(build_app(app_args), name="pdserve", route_prefix="/")
        print(f"Ray Serve app {app_args}{' (direct ingress)' if direct else ''} ready in "
              f"{time.perf_counter() - t0:.1f}s", flush=True)
        yield f"http://127.0.0.1:{port}"
    finally:
        try:
            serve.shutdown()
        finally:
            shutdown_router()
            ray.shutdown()
            os.environ.clear()
            os.environ.update(saved_env)


def router_counters() -> dict:
    """The running app's router counters (migrations, local prefills, prefix routing, ...)."""
    import ray

    from deployments.app import NAMESPACE, ROUTER_NAME

    router = ray.get_actor(ROUTER_NAME, namespace=NAMESPACE)
    return ray.get(router.stats.remote(), timeout=30)["counters"]


# ---------------------------------------------------------------------------------------------- output


def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "python": platform.python_version()}


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]],
                notes: Sequence[str] = (), console=None) -> None:
    """A rich table; numeric columns right-aligned. Falls back to plain text without rich."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # pragma: no cover - rich is a project dependency
        print(f"\n{title}")
        print(" | ".join(columns))
        for r in rows:
            print(" | ".join(str(c) for c in r))
        for n in notes:
            print(f"  * {n}")
        return
    console = console or Console(width=160)
    table = Table(title=title, title_justify="left")
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 else "right", overflow="fold")
    for r in rows:
        table.add_row(*("" if c is None else str(c) for c in r))
    console.print(table)
    for n in notes:
        console.print(f"  [dim]*[/dim] {n}")


def fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def _jsonable(obj: Any) -> Any:
    if is_dataclass(obj) and not isinstance(obj, type):
        return _jsonable(asdict(obj))
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


def write_json(path: str | Path, obj: Any) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_jsonable(obj), indent=2) + "\n")


# ---------------------------------------------------------------------------------------------- text workloads
COPY_INSTRUCTIONS = (
    "Repeat the following text exactly, word for word:\n\n{text}",
    "Copy this text, fixing any typos you find:\n\n{text}",
    "Rewrite the text below unchanged, then stop:\n\n{text}",
)


def repo_paragraphs(parts: Sequence[str], min_chars: int = 250, max_chars: int = 700,
                    shuffle_seed: int | None = None) -> list[str]:
    """Paragraphs of prose and code from this repository (`parts`: files, or folders whose *.md and
    *.py files are read, in sorted order): a fixed list for a given checkout, shuffled with
    `shuffle_seed` if given (consecutive cells then mix prose and code). Tables are left out."""
    import random
    import re

    root = Path(__file__).resolve().parents[1]
    paths = []
    for part in parts:
        p = root / part
        paths += sorted([*p.rglob("*.md"), *p.rglob("*.py")]) if p.is_dir() else [p]
    out = []
    for path in paths:
        for block in re.split(r"\n\s*\n", path.read_text()):
            block = block.strip()
            if min_chars <= len(block) <= max_chars and not block.startswith(("|", "<!--")):
                out.append(block)
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(out)
    return out
