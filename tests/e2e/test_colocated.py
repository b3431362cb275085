"""Colocated serving (num_prefill_workers=0): the router hands whole requests to decode workers, which
prefill them in their own batches. Same outputs as the offline engine, no KV moves, nothing leaks."""

from __future__ import annotations

import asyncio

import pytest
import ray

from deployments.config import ServeConfig
from deployments.frontend.router_client import RouterBackend
from deployments.frontend.stream_hub import StreamHub
from engine import LLM, SamplingParams
from engine.errors import EngineConfigError
from helpers import local_ray, pdserve_router, wait_finished, wait_no_leaks

PROMPTS = [[1 + (i * 37 + j * 11) % 4000 for j in range(n)] for i, n in enumerate((5, 40, 90, 17, 130, 64, 8, 33))]


@pytest.fixture(scope="module")
def colocated():
    cfg = ServeConfig.from_dict(dict(num_prefill_workers=0, num_decode_workers=2, kv_cache_memory_mb=64,
                                     max_num_batched_tokens=128))
    with local_ray(4, namespace="pdserve-colocated"), pdserve_router(cfg, timeout_s=300) as router:
        yield router, RouterBackend(router, StreamHub(), "hub-colocated", request_timeout_s=120)


def test_config_rejects_a_scaling_prefill_pool_when_colocated():
    with pytest.raises(EngineConfigError, match="prefill_max_workers"):
        ServeConfig(num_prefill_workers=0, prefill_max_workers=2)
    with pytest.raises(EngineConfigError, match="num_prefill_workers"):
        ServeConfig(num_prefill_workers=-1)
    assert ServeConfig(num_prefill_workers=0).colocated and not ServeConfig().colocated


def test_colocated_streams_match_offline_and_move_no_kv(colocated):
    router, backend = colocated
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in LLM(num_kv_blocks=128).generate(PROMPTS, params)]

    async def one(i, prompt):
        await asyncio.sleep(0.05 * i)  # arrivals spread over steps: later ones join running batches
        toks = []
        async for d in backend.generate(f"c{i}", prompt, params):
            toks += d.token_ids
        return toks

    async def run():
        return await asyncio.gather(*[one(i, p) for i, p in enumerate(PROMPTS)])

    assert asyncio.run(run()) == want
    stats = wait_finished(router, len(PROMPTS))
    assert stats["pools"]["prefill"]["size"] == 0
    assert stats["counters"]["finished"] == len(PROMPTS) and stats["counters"]["admitted"] == len(PROMPTS)
    assert all(d["num_steps"] > 0 for d in stats["decode"].values()), stats  # both workers served
    assert max(d["max_batch_seen"] for d in stats["decode"].values()) > 1, stats
    workers = ray.get(router.workers.remote())
    for w in workers.values():
        assert ray.get(w.kv_stats.remote())["num_received"] == 0
    wait_no_leaks(router, timeout_s=20)


def test_colocated_abort_mid_stream_frees_blocks(colocated):
    router, backend = colocated
    params = SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)

    async def partial():
        n = 0
        gen = backend.generate("abort-me", PROMPTS[4], params)
        async for d in gen:
            n += len(d.token_ids)
            if n >= 4:
                break
        await gen.aclose()
        return n

    assert asyncio.run(partial()) >= 4
    wait_no_leaks(router, timeout_s=30)
    assert ray.get(router.stats.remote())["counters"]["aborted"] >= 1


def test_colocated_repeats_go_where_their_prefix_is_cached(colocated):
    """Cache-aware placement without a prefill pool: 4 prompts spread over the 2 workers, then sent again
    in reverse order (most free blocks alone would put one on the other worker); each runs where its
    prefix is cached, every full block but the last token's comes from the cache, same tokens."""
    router, backend = colocated
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompts = [[100 + (k * 97 + j * 13) % 30000 for j in range(n)] for k, n in enumerate((120, 90, 150, 100))]

    async def wave(order: list[int], tag: str) -> dict[int, tuple[int, list[int]]]:
        out: dict[int, tuple[int, list[int]]] = {}

        async def one(i: int) -> None:
            await asyncio.sleep(0.1 * order.index(i))  # reach the router in this order
            deltas = [d async for d in backend.generate(f"aff-{tag}-{i}", prompts[i], params)]
            out[i] = (deltas[0].num_cached_tokens, [t for d in deltas for t in d.token_ids])

        await asyncio.wait_for(asyncio.gather(*[one(i) for i in order]), 120)
        return out

    first = asyncio.run(wave([0, 1, 2, 3], "first"))
    again = asyncio.run(wave([3, 2, 1, 0], "again"))
    for i, p in enumerate(prompts):
        assert again[i][1] == first[i][1]
        assert again[i][0] == (len(p) - 1) // 16 * 16, (i, again[i][0])
    wait_no_leaks(router, timeout_s=20)


def test_colocated_logprobs_reach_the_client(colocated):
    """The decode worker prefills itself here: its first output's prompt logprobs and every token's
    logprobs travel through the hub to the backend's deltas, aligned with the tokens."""
    router, backend = colocated
    prompt = PROMPTS[1]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2, prompt_logprobs=1)

    async def run():
        return [d async for d in backend.generate("c-logprobs", prompt, params)]

    deltas = asyncio.run(run())
    tokens = [t for d in deltas for t in d.token_ids]
    logprobs = [x for d in deltas for x in d.logprobs or []]
    assert len(tokens) == 6 and [x.token_id for x in logprobs] == tokens
    assert all(len(x.top) == 2 and x.logprob == x.top[0][1] for x in logprobs)  # greedy: the best token
    first = deltas[0].prompt_logprobs
    assert first is not None and first[0] is None and [x.token_id for x in first[1:]] == prompt[1:]
    assert all(d.prompt_logprobs is None for d in deltas[1:])
    wait_no_leaks(router, timeout_s=30)
