"""The engine's features through TP workers on Ray give the tokens of the single engine (CPU, gloo, a
tiny random-weight llama with 2 KV heads): one cluster for the module, a prefill worker of TP 2 and two
decode workers of TP 2 (every prompt through the prefill pool, its KV gathered on one side and scattered
on the other), speculative decoding (ngram) on.

- prefix caching: prompts sharing a prefix hit the TP prefill worker's cache, same greedy tokens;
- speculative decoding: drafts verified under TP on the decode workers, tokens accepted, same tokens;
- structured outputs: the grammar's first token sampled on the TP prefill worker, the rest on a TP
  decode worker, same tokens as the single engine under the same grammar;
- migration: a decode worker's rank 0 killed mid-stream; its sequences move to the other TP decode
  worker (pulling their cached prompt from the TP prefill worker where they can) and finish with the
  same tokens; its placement group is removed, a replacement joins, no block is left anywhere.

Slow (a 6-rank cluster of its own, ~2 min on 2 cores); tests/e2e/test_tp_serving.py keeps prefill TP 1 ->
decode TP 2 in the default run, and test_tensor_parallel.py these features on one engine of TP 2."""

from __future__ import annotations

import asyncio
import json
import random
import time

import pytest
import ray

from deployments.cluster.tp_ranks import placement_group_name
from deployments.config import ServeConfig
from deployments.frontend.router_client import RouterBackend
from deployments.frontend.stream_hub import StreamHub
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.structured import StructuredSpec
from helpers import local_ray, pdserve_router, run_offline, wait_for, wait_no_leaks

pytestmark = pytest.mark.slow

BASE = dict(kv_cache_memory_mb=16, max_num_batched_tokens=64, block_size=4, dtype="float32")
GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama")  # 4 heads, 2 KV heads: one KV head a rank


@pytest.fixture(scope="module")
def offline(model):
    """The single engine, speculation off: the reference."""
    return LLMEngine(EngineConfig(model=model, num_kv_blocks=256, block_size=4, dtype="float32",
                                  speculative_method="off"))


@pytest.fixture(scope="module")
def cluster(model):
    # 10 logical CPUs: 6 ranks, and a replacement decode worker's 2 after the kill.
    cfg = ServeConfig.from_dict(dict(model=model, num_prefill_workers=1, prefill_tp=2, num_decode_workers=2,
                                     decode_tp=2, speculative_method="ngram", speculative_adaptive=False,
                                     local_prefill_max_tokens=0, health_check_timeout_s=5.0, **BASE))
    with local_ray(10, namespace="pdserve-tp-features"), pdserve_router(cfg, timeout_s=300) as router:
        yield router, StreamHub()


def _generate(cluster, prompts, params, on_progress=None) -> tuple[list[list[int]], list[int]]:
    """Every prompt at once through the router as the ingress sends them: (tokens, prefix-cache hits)
    of each; `params` one for all or one per prompt."""
    router, hub = cluster
    params = params if isinstance(params, list) else [params] * len(prompts)
    backend = RouterBackend(router, hub, "hub-tpf", request_timeout_s=120)
    progress, cached = [0] * len(prompts), [0] * len(prompts)

    async def one(i):
        toks, first = [], True
        async for d in backend.generate(f"tpf{i}-{time.monotonic_ns()}", prompts[i], params[i]):
            assert d.finish_reason != "error", d.error
            if first and d.token_ids:
                cached[i], first = d.num_cached_tokens, False
            toks += d.token_ids
            progress[i] = len(toks)
        return toks

    async def run():
        tasks = [asyncio.create_task(one(i)) for i in range(len(prompts))]
        if on_progress is not None:
            await on_progress(progress)
        return await asyncio.wait_for(asyncio.gather(*tasks), 300)

    return asyncio.run(run()), cached


def _want(offline, prompts, params) -> list[list[int]]:
    params = params if isinstance(params, list) else [params] * len(prompts)
    return [run_offline(offline, [p], sp)[0].token_ids for p, sp in zip(prompts, params)]


def _accepted(router) -> int:
    decode = ray.get(router.stats.remote(), timeout=30)["decode"]
    return sum((w["speculation"] or {}).get("num_accepted", 0) for w in decode.values())


def test_prefix_cache_hits_on_a_tp_prefill_worker_give_the_same_tokens(cluster, offline):
    rng = random.Random(7)
    shared = [rng.randrange(3, 4000) for _ in range(32)]  # 8 full blocks of 4
    prompts = [shared + [rng.randrange(3, 4000) for _ in range(n)] for n in (3, 6, 11)]
    params = SamplingParams(max_tokens=12, speculative=False, **GREEDY)
    first, cached0 = _generate(cluster, prompts[:1], params)  # alone: its blocks are cached when it ends
    rest, cached = _generate(cluster, prompts[1:], params)
    assert first + rest == _want(offline, prompts, params)
    assert cached0 == [0] and cached == [32, 32]  # the shared prefix, from the TP-2 worker's cache
    wait_no_leaks(cluster[0])


def test_speculative_decoding_under_tp_gives_the_same_tokens(cluster, offline):
    rng = random.Random(11)
    loops = []
    for n in (9, 5, 7):
        base = [rng.randrange(3, 4000) for _ in range(n)]
        loops.append(base * 4)  # the tiny model's greedy output falls into loops; ngram drafts from them
    params = SamplingParams(max_tokens=40, **GREEDY)
    before = _accepted(cluster[0])
    got, _ = _generate(cluster, loops, params)
    assert got == _want(offline, loops, params)
    # Drafts were verified (several rows a sequence) on the TP-2 decode workers, and some accepted.
    wait_for(lambda: _accepted(cluster[0]), lambda n: n > before, timeout_s=30, what="accepted drafts reported")
    wait_no_leaks(cluster[0])


def test_structured_outputs_through_tp_workers_give_the_same_tokens(cluster, offline):
    tok = offline.tokenizer
    prompts = [tok.encode(t) for t in ("Pick a colour:", "Answer in JSON:", "A number:", "Another colour, please:")]
    colours = StructuredSpec("choice", json.dumps(["red", "green", "blue", "yellow"]))
    person = StructuredSpec("json_schema", json.dumps({
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer"}},
        "required": ["name", "age"], "additionalProperties": False}))
    params = [SamplingParams(max_tokens=12, temperature=0, structured=colours),
              SamplingParams(max_tokens=40, temperature=0, structured=person),
              SamplingParams(max_tokens=10, temperature=0, structured=StructuredSpec("regex", "[0-9]{2,6}")),
              SamplingParams(max_tokens=12, temperature=0, structured=colours, speculative=False)]
    got, _ = _generate(cluster, prompts, params)
    want = _want(offline, prompts, params)
    assert got == want
    texts = [tok.decode(t, skip_special_tokens=True) for t in got]
    assert texts[0] in ("red", "green", "blue", "yellow") and texts[3] in ("red", "green", "blue", "yellow")
    assert texts[2].isdigit() and 2 <= len(texts[2]) <= 6
    wait_no_leaks(cluster[0])


def _live_pg(worker_id: str) -> bool:
    return any(pg.get("name") == placement_group_name(worker_id) and pg["state"] != "REMOVED"
               for pg in ray.util.placement_group_table().values())


def test_a_tp_decode_worker_killed_mid_stream_its_sequences_finish_elsewhere(cluster, offline):
    """Last here: it kills a worker (the router replaces it before the module ends)."""
    router = cluster[0]
    rng = random.Random(13)
    prompts = [[rng.randrange(3, 4000) for _ in range(n)] for n in (5, 23, 40, 9, 17, 30)]
    prompts += [prompts[0][:4] * 5]  # a looping one: its moved sequence speculates again
    params = SamplingParams(max_tokens=60, **GREEDY)
    want = _want(offline, prompts, params)
    before = ray.get(router.stats.remote(), timeout=30)["counters"]
    killed = []

    async def kill(progress):
        deadline = time.monotonic() + 120
        while min(progress) < 5:  # every stream is decoding
            assert time.monotonic() < deadline, progress
            await asyncio.sleep(0.05)
        stats = await router.stats.remote()
        victim = max(stats["decode"], key=lambda w: stats["decode"][w]["running"])
        killed.append((victim, await router.workers.remote()))
        followers = await killed[0][1][victim].tp_followers.remote()
        killed.append(followers)
        ray.kill(killed[0][1][victim])  # rank 0: the worker

    got, _ = _generate(cluster, prompts, params, kill)
    assert got == want
    after = ray.get(router.stats.remote(), timeout=30)["counters"]
    assert after["worker_deaths"] == before["worker_deaths"] + 1
    assert after["migrations"] > before["migrations"]
    # Each moved sequence went to a TP-2 worker: the prefill worker (recomputing past its cached prompt,
    # then its KV scattered again) or the other decode worker (pulling the cached prompt from the
    # prefill worker: gathered there, scattered here). The prefill worker's cache saved some of it.
    moves = ray.get(router.stats.remote(), timeout=30)["moves"][-(after["migrations"] - before["migrations"]):]
    assert sum(m["recompute_tokens"] for m in moves) < sum(m["tokens"] for m in moves), moves
    victim, followers = killed[0][0], killed[1]
    wait_for(lambda: _live_pg(victim), lambda live: not live, timeout_s=60,
             what=f"{victim}'s placement group removed")
    for f in followers:  # its rank 1 ended with it
        wait_for(lambda: _gone(f), timeout_s=60, interval_s=0.5, what="the killed worker's follower ended")
    wait_for(lambda: ray.get(router.stats.remote(), timeout=30)["pools"]["decode"]["ready"], lambda n: n == 2,
             timeout_s=180, interval_s=0.5, what="a replacement TP decode worker ready")
    wait_no_leaks(router)


def _gone(actor) -> bool:
    try:
        ray.get(actor.ping.remote(), timeout=30)
    except ray.exceptions.RayActorError:
        return True
    return False
