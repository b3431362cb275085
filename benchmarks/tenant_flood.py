"""One tenant floods, another keeps its latency: the innocent tenant's time to first token (TTFT) alone,
beside a flood of 10x its share with tenants (weighted fair queueing, slot preemption: engine/fair_share.py),
and beside the same flood with no tenants (both sending with one shared key: first come, first served).
All three phases on one single-process server (the engine and the HTTP app in this process), side by side
in one run. The clients run in a process of their own, as they would on their own hosts: one GIL between
eleven clients' SSE parsing and the server's loop would add their work to every TTFT.

```
 innocent: --clients closed-loop streams ──HTTP──▶ uvicorn ──▶ LocalEngineBackend ──▶ LLMEngine
 flooder:  10 x --clients closed-loop streams, longer prompts and outputs (same weight: 10x its share)
```

The engine runs with --max-num-seqs slots, fewer than the flood's streams, so there is a queue to be fair
in. Run it on an idle host; the figures go to results.md.

    .venv/bin/python benchmarks/tenant_flood.py [--seconds 40 --clients 2 --threads 1 --json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from benchmarks.common import MODEL_NAME, engine_http_server  # noqa: E402
from deployments.frontend.tenants import TenantBook  # noqa: E402
from engine import EngineConfig  # noqa: E402

INNOCENT, FLOODER, SHARED = "sk-innocent-bench", "sk-flooder-bench", "sk-shared-bench"


def _p(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


async def _client(client: httpx.AsyncClient, key: str, prompt_len: int, max_tokens: int, stop_at: float,
                  ttfts: list[float], counts: dict, seed: int) -> None:
    rng = random.Random(seed)
    while time.monotonic() < stop_at:
        body = {"model": MODEL_NAME, "prompt": [rng.randrange(100, 20000) for _ in range(prompt_len)],
                "max_tokens": max_tokens, "stream": True, "ignore_eos": True, "temperature": 0}
        t0 = time.monotonic()
        first = None
        async with client.stream("POST", "/v1/completions", json=body,
                                 headers={"Authorization": f"Bearer {key}"}) as r:
            if r.status_code != 200:
                counts[r.status_code] = counts.get(r.status_code, 0) + 1
                await r.aread()
                await asyncio.sleep(0.5)
                continue
            async for line in r.aiter_lines():
                if first is None and line.startswith("data: {"):
                    first = time.monotonic() - t0
        counts[200] = counts.get(200, 0) + 1
        if first is not None:
            ttfts.append(first)


async def _phase(url: str, seconds: float, clients: int, flood: int, innocent_key: str, flood_key: str,
                 args, seed: int) -> dict:
    """One phase; `seed` tells its prompts from every other phase's (none is in the prefix cache)."""
    stop_at = time.monotonic() + seconds
    innocent: list[float] = []
    flooded: list[float] = []
    counts_i: dict = {}
    counts_f: dict = {}
    limits = httpx.Limits(max_connections=clients + flood + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as c:
        tasks = [_client(c, flood_key, args.flood_prompt, args.flood_tokens, stop_at, flooded, counts_f,
                         seed * 10_000 + 1000 + i)
                 for i in range(flood)]
        if flood:
            await asyncio.sleep(2.0)  # the flood fills the slots and the queue first
        tasks += [_client(c, innocent_key, args.prompt, args.tokens, stop_at, innocent, counts_i,
                          seed * 10_000 + i)
                  for i in range(clients)]
        await asyncio.gather(*tasks)
    return {"innocent_ttft_p50_s": _p(innocent, 0.5), "innocent_ttft_p99_s": _p(innocent, 0.99),
            "innocent_ttft_max_s": max(innocent, default=float("nan")), "innocent_requests": len(innocent),
            "innocent_status": counts_i, "flood_ttft_p50_s": _p(flooded, 0.5), "flood_requests": len(flooded),
            "flood_status": counts_f, "innocent_ttft_mean_s": statistics.fmean(innocent) if innocent else None,
            "innocent_ttfts_s": innocent}


def _phase_in_child(*a) -> dict:
    return asyncio.run(_phase(*a))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=40.0, help="length of each phase")
    p.add_argument("--clients", type=int, default=2, help="the innocent tenant's closed-loop streams")
    p.add_argument("--flood-factor", type=int, default=10, help="the flooder's streams per innocent stream")
    p.add_argument("--prompt", type=int, default=64, help="innocent prompt tokens")
    p.add_argument("--tokens", type=int, default=16, help="innocent output tokens")
    p.add_argument("--flood-prompt", type=int, default=256)
    p.add_argument("--flood-tokens", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=8, help="the engine's sequence slots")
    p.add_argument("--threads", type=int, default=1, help="the engine's torch threads")
    p.add_argument("--tenant-prefill-tokens", type=int, default=None,
                   help="EngineConfig.tenant_prefill_tokens (default: the engine's)")
    p.add_argument("--model", default=None, help="the model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()
    keys = {"tenants": [{"name": "innocent", "key": INNOCENT}, {"name": "flooder", "key": FLOODER}]}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(keys, f)
    book = TenantBook.from_file(f.name)
    os.unlink(f.name)
    cfg = EngineConfig(model=args.model, num_threads=args.threads, max_num_seqs=args.max_num_seqs,
                       tenant_prefill_tokens=args.tenant_prefill_tokens)
    flood = args.flood_factor * args.clients
    rows = {}
    clients = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
    with clients, engine_http_server(cfg, tenants=book, api_key=SHARED) as url:
        clients.submit(_phase_in_child, url, 4.0, 1, 0, INNOCENT, FLOODER, args, 0).result()  # warm up
        phases = {"alone": (0, INNOCENT, FLOODER),
                  f"beside {flood}-stream flood, tenants (fair)": (flood, INNOCENT, FLOODER),
                  f"beside {flood}-stream flood, one shared key (FCFS)": (flood, SHARED, SHARED)}
        for seed, (name, (n_flood, ikey, fkey)) in enumerate(phases.items(), start=1):
            rows[name] = row = clients.submit(_phase_in_child, url, args.seconds, args.clients, n_flood, ikey,
                                              fkey, args, seed).result()
            print(f"{name:>44}: innocent TTFT p50 {row['innocent_ttft_p50_s']:.3f} s, p99 "
                  f"{row['innocent_ttft_p99_s']:.3f} s, max {row['innocent_ttft_max_s']:.3f} s "
                  f"({row['innocent_requests']} requests); flood {row['flood_requests']} requests, "
                  f"TTFT p50 {row['flood_ttft_p50_s']:.3f} s", flush=True)
    base = rows["alone"]["innocent_ttft_p99_s"]
    for name, row in rows.items():
        row["p99_vs_alone"] = row["innocent_ttft_p99_s"] / base if base else None
        print(f"{name:>44}: p99 / alone p99 = {row['p99_vs_alone']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
