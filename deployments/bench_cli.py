"""`pdserve bench`: a load generator for any OpenAI-compatible server (streaming `/v1/completions`).

```
 arrivals (Poisson rate R, or all at once) ──▶ semaphore (max concurrency C) ──▶ POST /v1/completions
                                                                                   │ SSE chunks
   per request: t_send, t_first_chunk, t_chunk[i], t_done, usage.completion_tokens ◀┘
   → TTFT, TPOT = (E2E - TTFT) / (tokens - 1), ITL = chunk gaps, E2E, goodput under SLOs
```

The library entry is `run_benchmark(BenchConfig | dict) -> dict` (also `arun_benchmark` inside an event
loop). Token counts come from the final usage chunk (`stream_options.include_usage`); one token per
content chunk is only the fallback for servers that send no usage. The generator only talks to
`base_url`, sends at most `num_prompts` requests and stops everything after `timeout_s`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from deployments.bench_report import (  # noqa: F401 - re-exported: the library entry points
    BenchConfig, BenchRequest, Phase, RequestResult, _request_row, compute_metrics, phase_metrics, plot_results,
    print_report, server_speculation, speculation_delta, throughput_timeline)


# ---------------------------------------------------------------------------------------------- workload


def _length(rng: random.Random, fixed: int, lo_hi: tuple[int, int] | None) -> int:
    return rng.randint(*lo_hi) if lo_hi else fixed


def make_requests(cfg: BenchConfig) -> list[BenchRequest]:
    """The workload: the same list for the same config and seed."""
    rng = random.Random(cfg.seed)
    if cfg.dataset:
        rows = [json.loads(line) for line in Path(cfg.dataset).read_text().splitlines() if line.strip()]
        if not rows or any("prompt" not in r for r in rows):
            raise ValueError(f"{cfg.dataset}: every line must be a JSON object with a \"prompt\" field")
        picks = [rows[rng.randrange(len(rows))] for _ in range(cfg.num_prompts)]
        return [BenchRequest(r["prompt"], int(r.get("max_tokens") or _length(rng, cfg.output_len, cfg.output_len_range)))
                for r in picks]
    out = []
    prefixes = [[rng.randrange(cfg.low_token_id, cfg.vocab_size) for _ in range(cfg.prefix_len)]
                for _ in range(cfg.prefix_groups)]
    if cfg.phases:  # each phase its own lengths, one after another
        for ph in cfg.phases:
            for _ in range(ph.num_prompts):
                prompt = [rng.randrange(cfg.low_token_id, cfg.vocab_size) for _ in range(ph.input_len)]
                if prefixes:
                    prompt = prefixes[rng.randrange(len(prefixes))] + prompt
                out.append(BenchRequest(prompt, ph.output_len))
        return out
    for _ in range(cfg.num_prompts):
        n = _length(rng, cfg.input_len, cfg.input_len_range)
        prompt = [rng.randrange(cfg.low_token_id, cfg.vocab_size) for _ in range(n)]
        if prefixes:
            prompt = prefixes[rng.randrange(len(prefixes))] + prompt
        out.append(BenchRequest(prompt, _length(rng, cfg.output_len, cfg.output_len_range)))
    return out


def arrival_offsets(cfg: BenchConfig) -> list[float]:
    """Send times (s after start): a Poisson process at `request_rate`, or all zero for inf. With phases,
    each phase's process starts one random gap after the previous phase's last arrival: a gap of the
    previous phase's rate, or of its own after a burst (an inf-rate phase, sent all at once), so a phase
    never starts at the same instant as the burst before it."""
    if cfg.phases:
        rng = random.Random(cfg.seed + 1)
        t, out = 0.0, []
        for k, ph in enumerate(cfg.phases):
            if k and math.isinf(cfg.phases[k - 1].request_rate) and not math.isinf(ph.request_rate):
                t += rng.expovariate(ph.request_rate)
            for _ in range(ph.num_prompts):
                out.append(t)
                if not math.isinf(ph.request_rate):
                    t += rng.expovariate(ph.request_rate)
        return out
    if math.isinf(cfg.request_rate):
        return [0.0] * cfg.num_prompts
    rng = random.Random(cfg.seed + 1)
    t, out = 0.0, []
    for _ in range(cfg.num_prompts):
        out.append(t)
        t += rng.expovariate(cfg.request_rate)
    return out


# ---------------------------------------------------------------------------------------------- client


async def _send(client: Any, cfg: BenchConfig, req: BenchRequest, res: RequestResult, t0: float) -> None:
    body = {"model": cfg.model, "prompt": req.prompt, "max_tokens": req.max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0.0, "ignore_eos": cfg.ignore_eos}
    res.start = time.perf_counter() - t0
    num_chunks = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:200]
                res.error = f"HTTP {resp.status_code}: {text}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter() - t0
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = f"in-stream error: {chunk['error']}"
                    return
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    res.num_output_tokens = int(usage.get("completion_tokens") or 0)
                    res.num_prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    res.num_cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
                    res.usage_reported = True
                choices = chunk.get("choices") or []
                if not choices:
                    continue
                if res.ttft is None:
                    res.ttft = now - res.start
                if choices[0].get("text"):
                    res.chunk_times.append(now)
                    num_chunks += 1
        res.e2e = time.perf_counter() - t0 - res.start
        if not res.usage_reported:
            res.num_output_tokens = num_chunks  # NOTE: fallback only; a chunk may hold several tokens
        res.ok = res.ttft is not None
        if not res.ok:
            res.error = "the stream ended without a completion chunk"
    except asyncio.CancelledError:
        res.error = res.error or "cancelled: the run's timeout_s passed"
        raise
    except Exception as e:  # noqa: BLE001 - any transport/parse failure is one failed request
        res.error = f"{type(e).__name__}: {e}"


async def arun_benchmark(cfg: BenchConfig | dict) -> dict:
    """`run_benchmark` for callers already inside an event loop."""
    import httpx

    if isinstance(cfg, dict):
        cfg = BenchConfig.from_dict(cfg)
    requests = make_requests(cfg)
    offsets = arrival_offsets(cfg)
    results = [RequestResult(i, r.max_tokens) for i, r in enumerate(requests)]
    limit = cfg.max_concurrency or cfg.num_prompts
    sem = asyncio.Semaphore(limit)
    bar = _progress(cfg)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    # NOTE: trust_env=False: never route through an environment proxy; talk to base_url only.
    async with httpx.AsyncClient(base_url=cfg.base_url, headers=headers, trust_env=False, follow_redirects=False,
                                 timeout=httpx.Timeout(cfg.timeout_s, connect=min(cfg.timeout_s, 30.0)),
                                 limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit)) as client:
        spec_before = await _server_speculation(client)
        t0 = time.perf_counter()

        async def one(i: int) -> None:
            await asyncio.sleep(max(0.0, offsets[i] - (time.perf_counter() - t0)))
            async with sem:
                await _send(client, cfg, requests[i], results[i], t0)
            if bar is not None:
                bar.update(1)

        tasks = [asyncio.create_task(one(i)) for i in range(cfg.num_prompts)]
        _, pending = await asyncio.wait(tasks, timeout=cfg.timeout_s)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        duration = time.perf_counter() - t0
        spec_after = await _server_speculation(client)
    if bar is not None:
        bar.close()
    for r in results:
        if not r.ok and r.error is None:
            r.error = "not finished within timeout_s"
    out = {"config": asdict(cfg), "metrics": compute_metrics(cfg, results, duration),
           "requests": [_request_row(r) for r in results]}
    out["timeline"] = throughput_timeline(results)
    out["phases"] = phase_metrics(cfg, results)
    out["server_speculation"] = speculation_delta(spec_before, spec_after)
    if cfg.result_json:
        Path(cfg.result_json).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.result_json).write_text(json.dumps(out, indent=2) + "\n")
    if cfg.plot:
        plot_results(out, results, cfg.plot)
    return out


async def _server_speculation(client: Any) -> dict[str, dict[str, Any]]:
    """The server's per-decode-worker speculation counters from its `/health` (pdserve's, with the API
    key); {} from any other server or answer: the report then has no speculation rows."""
    try:
        resp = await client.get("/health", timeout=10.0)
        return server_speculation(resp.json()) if resp.status_code == 200 else {}
    except Exception:  # noqa: BLE001 - an optional reading; the benchmark does not depend on it
        return {}


def run_benchmark(cfg: BenchConfig | dict) -> dict:
    """Run one benchmark to completion; returns {"config", "metrics", "requests", "timeline",
    "server_speculation"} (the last: what the server's decode workers drafted and accepted during the
    run, from its /health; None when it does not speculate)."""
    return asyncio.run(arun_benchmark(cfg))


def _progress(cfg: BenchConfig):
    if not cfg.progress:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        return None
    return tqdm(total=cfg.num_prompts, desc="requests", unit="req", file=sys.stderr, dynamic_ncols=True)


# ---------------------------------------------------------------------------------------------- metrics


def _range(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO,HI (two integers), got {text!r}") from None
    return lo, hi


def _phase(text: str) -> Phase:
    try:
        return Phase.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    b = subparsers.add_parser("bench", help="load-test an OpenAI-compatible server (streaming /v1/completions)")
    b.add_argument("--base-url", default="http://127.0.0.1:8000")
    b.add_argument("--model", required=True, help="the `model` field sent with each request")
    b.add_argument("--num-prompts", type=int, default=100)
    b.add_argument("--request-rate", type=float, default=math.inf, help="Poisson requests/s; inf: all at once")
    b.add_argument("--max-concurrency", type=int, default=None)
    b.add_argument("--input-len", type=int, default=128)
    b.add_argument("--input-len-range", type=_range, default=None, metavar="LO,HI")
    b.add_argument("--output-len", type=int, default=128)
    b.add_argument("--output-len-range", type=_range, default=None, metavar="LO,HI")
    b.add_argument("--dataset", default=None, help="JSONL file with a \"prompt\" field per line")
    b.add_argument("--vocab-size", type=int, default=32000, help="random prompt token ids stay below this")
    b.add_argument("--prefix-groups", type=int, default=0,
                   help="shared-prefix workload: this many distinct random prefixes, one per prompt")
    b.add_argument("--prefix-len", type=int, default=0, help="tokens of each shared prefix")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--timeout-s", type=float, default=600.0, help="bound on the whole run")
    b.add_argument("--slo-ttft-ms", type=float, default=None)
    b.add_argument("--slo-tpot-ms", type=float, default=None)
    b.add_argument("--api-key", default=None)
    b.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false")
    b.add_argument("--no-progress", dest="progress", action="store_false")
    b.add_argument("--phase", dest="phases", action="append", type=_phase, default=None, metavar="N,IN,OUT[,RATE]",
                   help="a phase of a shifting load (repeat in order): N prompts of IN tokens asking for OUT, at "
                        "RATE/s; replaces --num-prompts, the lengths and --request-rate; figures per phase")
    b.add_argument("--result-json", default=None, metavar="PATH")
    b.add_argument("--plot", default=None, metavar="PATH.png")
    b.set_defaults(func=_bench)
    return b


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    names = {f.name for f in fields(BenchConfig)}
    given = {k: v for k, v in vars(args).items() if k in names}
    if given.get("phases") is not None:
        given["phases"] = tuple(given["phases"])
    return BenchConfig(**given)


def _bench(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        print(f"pdserve bench: {e}", file=sys.stderr)
        return 2
    result = run_benchmark(cfg)
    print_report(result)
    if cfg.result_json:
        print(f"results: {cfg.result_json}")
    if cfg.plot:
        print(f"plot: {cfg.plot}")
    return 0 if result["metrics"]["completed"] else 1
