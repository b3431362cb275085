"""Figures for failures and scaling under a steady load on the CPU app (1 prefill + 2 decode workers):

1. kill one decode worker mid-load (fixed pools; `--trials` kills, each on a fresh app and later in the
   load than the last): requests lost (target 0), the longest stall a client sees from the kill (its
   longest gap between two tokens that ends after the kill; target: < one re-prefill of the longest
   sequence + 1 s), the longest gap before the kill (the steady load's own, for comparison), and
   whether outputs equal an undisturbed run (greedy);
2. a prefill burst on a fresh app whose prefill pool may grow from 1 to 2: time from the burst to the
   scale-up decision, to the new worker being ready, and to it serving its first step.

    .venv/bin/python benchmarks/fault_figures.py [--num-requests 16 --rate 1.5 --kill-at 6 --trials 3 --kill-step 1.5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402

from deployments.app import get_or_create_router, shutdown_router  # noqa: E402
from deployments.config import ServeConfig  # noqa: E402
from deployments.frontend.router_client import RouterBackend  # noqa: E402
from deployments.frontend.stream_hub import StreamHub  # noqa: E402
from engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402


def workload(n: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(100, 49152) for _ in range(rng.randint(64, 256))], rng.randint(48, 96)) for _ in range(n)]


def reference(reqs, threads: int) -> tuple[list[list[int]], float]:
    """Undisturbed greedy outputs, and the time to prefill the longest sequence (prompt + output) once."""
    eng = LLMEngine(EngineConfig(model=None, num_threads=threads, num_kv_blocks=2048))
    for i, (p, m) in enumerate(reqs):
        eng.add_request(str(i), p, SamplingParams(max_tokens=m, temperature=0, ignore_eos=True))
    out = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                out[int(o.request_id)] = o.token_ids
    longest = max(len(p) + m for p, m in reqs)
    eng.add_request("timing", [7] * longest, SamplingParams(max_tokens=1, temperature=0))
    t0 = time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step()
    return [out[i] for i in range(len(reqs))], time.perf_counter() - t0


async def steady_load_with_kill(backend, router, reqs, rate: float, kill_at: float, seed: int):
    """Returns each request's gaps between tokens as (began, length) in s since the start, and more."""
    rng = random.Random(seed)
    gaps: list[list[tuple[float, float]]] = [[] for _ in reqs]
    errors: list[str | None] = [None] * len(reqs)
    t0 = time.monotonic()

    async def one(i, prompt, max_tokens, delay):
        await asyncio.sleep(delay)
        toks, last = [], None
        try:
            async for d in backend.generate(f"s{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                            ignore_eos=True)):
                now = time.monotonic()
                if d.token_ids and last is not None:
                    gaps[i].append((last - t0, now - last))
                if d.token_ids:
                    last = now
                if d.finish_reason == "error":
                    errors[i] = d.error
                toks += d.token_ids
        except Exception as exc:  # noqa: BLE001
            errors[i] = repr(exc)
        return toks

    delays, t = [], 0.0
    for _ in reqs:
        delays.append(t)
        t += rng.expovariate(rate)
    tasks = [asyncio.create_task(one(i, p, m, delays[i])) for i, (p, m) in enumerate(reqs)]
    await asyncio.sleep(kill_at)
    workers = await router.workers.remote()
    victim = sorted(w for w in workers if "decode" in w)[0]
    ray.kill(workers[victim])
    killed_at = time.monotonic() - t0
    outs = await asyncio.wait_for(asyncio.gather(*tasks), 900)
    return outs, gaps, errors, victim, killed_at


async def burst(backend, router, n: int, prompt_len: int):
    t0 = time.time()

    async def one(i):
        async for _ in backend.generate(f"b{i}", [100 + (i * 13 + j) % 40000 for j in range(prompt_len)],
                                        SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)):
            pass

    task = asyncio.gather(*[one(i) for i in range(n)])
    decided = ready = serving = None
    while not (decided and ready and serving):
        await asyncio.sleep(0.2)
        stats = await router.stats.remote()
        ups = [d for d in stats["decisions"] if d["pool"] == "prefill" and d["action"] == "scale_up" and d["time"] >= t0]
        if ups and decided is None:
            decided = ups[0]["time"] - t0
        new = [(wid, w) for wid, w in stats["prefill"].items() if w["created_at"] >= t0]
        if new and new[0][1]["ready_at"] and ready is None:
            ready = new[0][1]["ready_at"] - t0
        if new and ready is not None and serving is None:
            use = await router.check_integrity.remote()
            if use.get(new[0][0], {}).get("num_steps", 0) > 0:
                serving = time.time() - t0
        if time.time() - t0 > 300:
            break
        if task.done() and not new:
            break
    await task
    return decided, ready, serving


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--rate", type=float, default=1.5)
    p.add_argument("--kill-at", type=float, default=6.0, help="seconds into the load of the first kill")
    p.add_argument("--trials", type=int, default=3, help="kills, each on a fresh app")
    p.add_argument("--kill-step", type=float, default=1.5, help="each trial kills this much later than the last")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-mb", type=int, default=2048,
                   help="KV pool per worker (the server's default). With too small a pool the survivor cannot "
                        "hold the dead worker's sequences, and they wait for the replacement to load its model")
    p.add_argument("--local-prefill-max-tokens", type=int, default=ServeConfig().local_prefill_max_tokens,
                   help="conditional disaggregation (the server's default; 0: every prompt through the prefill pool)")
    p.add_argument("--decode-max-prefill-tokens", type=int, default=ServeConfig().decode_max_prefill_tokens)
    p.add_argument("--no-kv-backup", action="store_true",
                   help="decode workers do not copy prompts they prefilled to the prefill pool (kv_backup off)")
    p.add_argument("--no-kv-prefix-fetch", action="store_true",
                   help="a sequence moved to a decode worker recomputes its whole prompt there instead of pulling "
                        "the part a prefill worker caches (kv_prefix_fetch off)")
    p.add_argument("--no-burst", action="store_true", help="only the kills, not the prefill burst")
    p.add_argument("--burst-kv-cache-mb", type=int, default=128, help="KV pool per worker in the burst phase")
    args = p.parse_args(argv)

    reqs = workload(args.num_requests, args.seed)
    print("reference run (undisturbed, in-process) ...", flush=True)
    want, reprefill_s = reference(reqs, threads=1)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, namespace="pdserve-figures")
    try:
        # Phase 1 runs fixed pools (1 prefill + 2 decode), so the stall measures recovery alone and not
        # a prefill scale-up that happens to start at the same time; phase 2 gets a fresh app that scales.
        cfg = ServeConfig.from_dict(dict(num_prefill_workers=1, num_decode_workers=2, health_check_timeout_s=5.0,
                          kv_cache_memory_mb=args.kv_cache_mb, local_prefill_max_tokens=args.local_prefill_max_tokens,
                          decode_max_prefill_tokens=args.decode_max_prefill_tokens, kv_backup=not args.no_kv_backup,
                          kv_prefix_fetch=not args.no_kv_prefix_fetch))
        target = reprefill_s + 1
        longest = max(len(p) + m for p, m in reqs)
        summary, backups = [], []
        for trial in range(args.trials):
            # A fresh app per trial, the kill a little later each time: which sequences the victim holds,
            # and how far along they are, changes the stall more than anything else.
            kill_at = args.kill_at + args.kill_step * trial
            router = get_or_create_router(cfg)
            ray.get(router.wait_ready.remote(600), timeout=700)
            backend = RouterBackend(router, StreamHub.remote(), f"hub-figures-{trial}", request_timeout_s=300)
            print(f"steady load, killing a decode worker at {kill_at:.1f}s (trial {trial + 1}/{args.trials}) ...",
                  flush=True)
            outs, all_gaps, errors, victim, killed_at = asyncio.run(
                steady_load_with_kill(backend, router, reqs, args.rate, kill_at, args.seed))
            # The stall a client sees from the kill: its longest gap that ends after the kill. Gaps that
            # ended before it are the steady load's own (a step with a prefill chunk, an admission).
            after = [max(((g, at) for at, g in gs if at + g > killed_at), default=(0.0, 0.0)) for gs in all_gaps]
            before = max((g for gs in all_gaps for at, g in gs if at + g <= killed_at), default=0.0)
            gaps, gap_at = [g for g, _ in after], [at for _, at in after]
            stats = ray.get(router.stats.remote())
            lost = sum(1 for o, (_, m), e in zip(outs, reqs, errors) if e or len(o) != m)
            identical = sum(1 for o, w in zip(outs, want) if o == w)
            migrated = stats["counters"]["migrations"]
            backups.append(stats["counters"]["kv_backups"])
            summary.append((killed_at, lost, identical, migrated, max(gaps), before))
            print(f"\n== kill {victim} at t={killed_at:.1f}s under {args.rate} req/s, {len(reqs)} requests")
            print(f"requests lost: {lost} (target 0); outputs identical to the undisturbed run: {identical}/{len(reqs)}")
            print(f"longest gap between two tokens before the kill (the steady load's own): {before:.2f}s")
            print(f"migrated sequences: {migrated}; longest client stall from the kill: {max(gaps):.2f}s; "
                  f"re-prefill of the longest sequence ({longest} tokens, 1 thread): "
                  f"{reprefill_s:.2f}s -> target < {target:.2f}s: {'met' if max(gaps) < target else 'MISSED'}")
            for i, (o, (_, m), e, w) in enumerate(zip(outs, reqs, errors, want)):
                if e or len(o) != m or o != w or gaps[i] > 1.0:
                    print(f"  request {i}: {len(o)}/{m} tokens, identical={o == w}, longest gap {gaps[i]:.2f}s "
                          f"from t={gap_at[i]:.1f}s, error={e}")
            print("  router decisions:", [(round(d['time'] - time.time(), 1), d['pool'], d['action'], d['reason'])
                                          for d in stats['decisions']])
            print("  moves (to, tokens, recomputed there, prompt tokens queued ahead, cached prefix pulled from):",
                  [(m["to"], m["tokens"], m["recompute_tokens"], m["tokens_ahead"], m.get("fetch_from"))
                   for m in stats["moves"]])
            shutdown_router()
        print(f"\n== {len(summary)} kills: requests lost {sum(x[1] for x in summary)} (target 0); identical outputs "
              f"{sum(x[2] for x in summary)}/{len(summary) * len(reqs)}; migrated "
              f"{', '.join(str(x[3]) for x in summary)}; longest stall "
              f"{', '.join(f'{x[4]:.2f}' for x in summary)} s (target < {target:.2f} s: met in "
              f"{sum(x[4] < target for x in summary)}/{len(summary)}); longest gap before the kill "
              f"{', '.join(f'{x[5]:.2f}' for x in summary)} s; KV backups {', '.join(str(b) for b in backups)}")
        if args.no_burst:
            return 0
        print("\nprefill burst (fresh app: 1 prefill worker, may scale to 2) ...", flush=True)
        # NOTE: a small pool here, as in the runs before the CPU pool was zero-filled lazily (until then a
        # 2 GB pool took seconds to zero at start, which hid the scaling path's own latency), so the
        # figures stay comparable. And no local prefill: decode workers prefilling part of the burst would shorten it until it
        # ends before the new worker starts, and this phase measures the prefill pool's scale-up path.
        cfg = replace(cfg, prefill_max_workers=2, prefill_target_queued_tokens=1024, upscale_delay_s=1.0,
                      downscale_delay_s=30.0, local_prefill_max_tokens=0,
                      engine=replace(cfg.engine, kv_cache_memory_mb=args.burst_kv_cache_mb))
        router = get_or_create_router(cfg)
        ray.get(router.wait_ready.remote(600), timeout=700)
        backend = RouterBackend(router, StreamHub.remote(), "hub-burst", request_timeout_s=300)
        decided, ready, serving = asyncio.run(burst(backend, router, 16, 400))
        f = lambda x: "-" if x is None else f"{x:.1f}s"  # noqa: E731
        print(f"\n== burst of 16 x 400-token prompts: scale-up decided after {f(decided)}, new prefill worker "
              f"ready after {f(ready)}, serving after {f(serving)}")
    finally:
        shutdown_router()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
