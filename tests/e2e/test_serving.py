"""The whole stack on CPU: Serve ingress -> router -> 2 prefill + 2 decode actors, real SmolLM2, the
official openai client. Greedy outputs must equal the offline engine's."""

from __future__ import annotations

import concurrent.futures as cf
import json
import time

import httpx
import pytest
import ray
from openai import OpenAI
from ray import serve

from deployments.app import NAMESPACE, ROUTER_NAME, build_app, build_grpc_app
from engine import EngineConfig, LLMEngine, SamplingParams
from helpers import free_port, local_serve, read_until_every_choice, run_offline, wait_finished, wait_for, wait_no_leaks

MODEL = "SmolLM2-135M-Instruct"
QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
    "Explain what a KV cache is in one sentence.", "Hi", "What is 12 times 7?", "Why is the sky blue?",
    "Name a famous painting by Leonardo da Vinci.", "Give me a synonym for happy.", "What do bees make?",
    "Describe a cat in five words.", "What is the boiling point of water?", "Say hello in French.",
    "Count from one to five.", "What color is grass?", "Name a planet in our solar system.",
]


@pytest.fixture(scope="module")
def server():
    gport = free_port()
    with local_serve(4, grpc_port=gport) as port:
        args = {"num_prefill_workers": 2, "num_decode_workers": 2, "kv_cache_memory_mb": 96, "max_num_seqs": 16}
        serve.run(build_app(args), name="pdserve", route_prefix="/")
        serve.run(build_grpc_app(args), name="pdserve-grpc", route_prefix="/pdserve-grpc")
        router = ray.get_actor(ROUTER_NAME, namespace=NAMESPACE)
        yield f"http://127.0.0.1:{port}", router, gport


@pytest.fixture(scope="module")
def offline():
    return LLMEngine(EngineConfig(model=None, num_kv_blocks=256))


def offline_chat(engine: LLMEngine, question: str, max_tokens: int) -> str:
    ids = engine.apply_chat_template([{"role": "user", "content": question}])
    return run_offline(engine, [ids], SamplingParams(max_tokens=max_tokens, temperature=0))[0].text


def offline_completion_ids(engine: LLMEngine, prompt: str, max_tokens: int) -> list[int]:
    return run_offline(engine, [prompt], SamplingParams(max_tokens=max_tokens, temperature=0))[0].token_ids


def test_openai_client_chat_and_completions_match_offline(server, offline):
    url, router, _ = server
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    q = QUESTIONS[0]
    want = offline_chat(offline, q, 24)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": q}], max_tokens=24,
                                       temperature=0)
    assert r.choices[0].message.content == want
    assert "Paris" in want
    chunks = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": q}], max_tokens=24,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    parts, usage = [], None
    for ch in chunks:
        if ch.choices and ch.choices[0].delta.content:
            parts.append(ch.choices[0].delta.content)
        if ch.usage:
            usage = ch.usage
    assert "".join(parts) == want
    assert usage is not None and usage.completion_tokens > 0

    prompt = "The three primary colors are"
    want_ids = offline_completion_ids(offline, prompt, 16)
    want_text = offline.tokenizer.decode(want_ids, skip_special_tokens=True)
    c = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    assert c.choices[0].text == want_text
    assert c.usage.completion_tokens == len(want_ids)
    s = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True)
    assert "".join(ch.choices[0].text for ch in s if ch.choices) == want_text
    wait_no_leaks(router, timeout_s=20)


def test_16_concurrent_streams_join_running_batches(server, offline):
    url, router, _ = server
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    wants = [offline_chat(offline, q, 32) for q in QUESTIONS]

    def one(q: str) -> str:
        out = []
        for ch in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": q}],
                                                 max_tokens=32, temperature=0, stream=True):
            if ch.choices and ch.choices[0].delta.content:
                out.append(ch.choices[0].delta.content)
        return "".join(out)

    with cf.ThreadPoolExecutor(16) as pool:
        got = list(pool.map(one, QUESTIONS))
    assert got == wants
    stats = wait_finished(router, 16)
    assert all(d["num_steps"] > 0 for d in stats["decode"].values()), stats  # both decode workers served
    assert max(d["max_batch_seen"] for d in stats["decode"].values()) > 1, stats
    wait_no_leaks(router, timeout_s=20)


def test_repeated_prompts_go_where_their_prefix_is_cached(server):
    """Cache-aware routing: 4 long prompts spread over the 2 prefill workers; sent again in reverse
    order (so queue length alone would place some on the other worker), each goes back where its
    prefix is cached: usage reports every full block but the last token's as cached, same tokens."""
    import torch

    url, router, _ = server
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    prompts = [[int(t) for t in torch.randint(1000, 40000, (n,), generator=torch.Generator().manual_seed(n))]
               for n in (200, 150, 260, 180)]
    before = ray.get(router.stats.remote())["counters"]

    def send(order: list[int]) -> dict[int, object]:
        def one(i: int):
            time.sleep(0.1 * order.index(i))  # reach the router in this order, all queued together
            return client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=4, temperature=0,
                                             extra_body={"ignore_eos": True})
        with cf.ThreadPoolExecutor(len(order)) as pool:
            return dict(zip(order, pool.map(one, order)))

    first = send([0, 1, 2, 3])
    again = send([3, 2, 1, 0])
    for i, p in enumerate(prompts):
        assert again[i].choices[0].text == first[i].choices[0].text
        assert again[i].usage.prompt_tokens_details.cached_tokens == (len(p) - 1) // 16 * 16, (i, again[i].usage)
    after = ray.get(router.stats.remote())["counters"]
    assert after["prefix_routed"] - before["prefix_routed"] >= 4
    wait_no_leaks(router, timeout_s=20)


def test_cache_salt_keeps_tenants_apart_through_the_pools(server):
    """A salted prompt hits the prefix cache only for requests with the same salt (prefill and decode
    pools, the router's prefix index): the same tokens come back either way."""
    import torch

    url, router, _ = server
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    prompt = [int(t) for t in torch.randint(1000, 40000, (130,), generator=torch.Generator().manual_seed(7))]

    def send(salt: str):
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                         extra_body={"ignore_eos": True, "cache_salt": salt})

    first, same, other = send("tenant-a"), send("tenant-a"), send("tenant-b")
    assert same.usage.prompt_tokens_details.cached_tokens == (len(prompt) - 1) // 16 * 16
    assert (other.usage.prompt_tokens_details.cached_tokens or 0) == 0
    assert first.choices[0].text == same.choices[0].text == other.choices[0].text
    wait_no_leaks(router, timeout_s=20)


@pytest.mark.parametrize("body,status,param", [
    ({"model": MODEL, "prompt": "hi", "n": 17}, 400, "n"),
    ({"model": MODEL, "prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "hi " * 9000}, 400, "prompt"),
    ({"model": "no-such-model", "prompt": "hi"}, 404, "model"),
])
def test_bad_input_gets_openai_errors(server, body, status, param):
    url, router, _ = server
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["param"] == param
    bad = httpx.post(f"{url}/v1/chat/completions", content=b"{not json", timeout=60,
                     headers={"Content-Type": "application/json"})
    assert bad.status_code == 400 and "error" in bad.json()
    ok = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200


def test_disconnect_mid_stream_frees_blocks_everywhere(server):
    url, router, _ = server
    body = {"model": MODEL, "prompt": "Tell me a very long story", "max_tokens": 2000, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        n = 0
        for line in r.iter_lines():
            if line.startswith("data: {"):
                json.loads(line[6:])
                n += 1
            if n >= 5:
                break
    wait_no_leaks(router, timeout_s=30)
    stats = ray.get(router.stats.remote())
    assert stats["counters"]["aborted"] >= 1


@pytest.mark.parametrize("stream", [True, False])
def test_a_fan_out_client_that_disconnects_has_every_sequence_aborted(server, stream):
    # n choices of batched prompts, each long enough to run for minutes: the client goes away (a
    # streamed one after a few chunks, a non-streamed one when its read times out) and every one of
    # its sequences must end on every worker, not run to max_tokens.
    url, router, _ = server
    before = ray.get(router.stats.remote())["counters"]["aborted"]
    body = {"model": MODEL, "prompt": ["Tell me a very long story", "Write a very long poem"], "n": 3,
            "max_tokens": 2000, "ignore_eos": True, "temperature": 1.0, "stream": stream}
    if stream:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            assert len(read_until_every_choice(r, 6)) == 6  # every sequence has started
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/completions", json=body, timeout=httpx.Timeout(60, read=8))
    wait_no_leaks(router, timeout_s=30)  # 2000 tokens each would take minutes
    assert ray.get(router.stats.remote())["counters"]["aborted"] - before >= 6


def test_grpc_generate_streams_same_tokens(server, offline):
    import grpc

    from deployments.frontend.grpc import pdserve_pb2, pdserve_pb2_grpc

    _, router, gport = server
    q = QUESTIONS[2]
    want = offline_chat(offline, q, 24)
    with grpc.insecure_channel(f"127.0.0.1:{gport}") as channel:
        stub = pdserve_pb2_grpc.GenerationStub(channel)
        req = pdserve_pb2.GenerateRequest(messages=[pdserve_pb2.ChatMessage(role="user", content=q)],
                                          max_tokens=24, temperature=0)
        chunks = list(stub.Generate(req, metadata=(("application", "pdserve-grpc"),), timeout=120))
    assert "".join(c.text for c in chunks) == want
    assert len(chunks) > 1 and chunks[-1].finish_reason
    wait_no_leaks(router, timeout_s=20)


def test_status_maps_pools_workers_and_kv_pairs_with_failures_by_cause(server, capsys):
    """`pdserve status` against this disaggregated deployment: every worker with its node and device,
    the queues, and each KV pair with its transport, probe and transfers; a pull refused because the
    lease ended (injected: a real prefix lease released before the decode worker pulls it) shows in
    /health and in the map as a failure by cause."""
    from deployments.cli import main
    from deployments.cluster.messages import GenRequest
    from deployments.frontend.hub_wire import HubAddress

    url, router, _ = server
    ids = list(range(200, 264))  # 64 tokens: whole blocks the prefill worker keeps in its prefix cache
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": ids, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    workers = ray.get(router.workers.remote())
    decode_id = "pdserve-decode-0"
    leased = [(wid, h) for wid in sorted(workers) if "prefill" in wid
              if (h := ray.get(workers[wid].kv_lease_prefix.remote("ghost", ids, 64, None, decode_id)))]
    assert leased, "the prompt's blocks are cached on a prefill worker"
    src, handle = leased[0]
    assert ray.get(workers[src].kv_release.remote(handle.request_id, handle.epoch))
    req = GenRequest("ghost", ids, SamplingParams(max_tokens=1), "hub-none", HubAddress("127.0.0.1", 1, b"k"))
    refused = ray.get(workers[decode_id].admit.remote(req, handle, workers[src]))
    assert not refused.accepted and refused.retry and "LeaseExpiredError" in refused.reason

    def pair() -> dict | None:
        pairs = httpx.get(f"{url}/health", timeout=10).json()["router"]["kv_pairs"]
        return next((p for p in pairs if (p["src"], p["dst"]) == (src, decode_id)), None)

    p = wait_for(pair, lambda p: p is not None and p["failures"].get("lease_expired"), timeout_s=30,
                 what="the refused pull in the router's view of the pair")
    assert p["transport"] == "gloo" and p["probe_gbps"] > 0 and p["num_opens"] >= 1

    capsys.readouterr()
    assert main(["status", "--url", url, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    router_doc = doc["router"]
    assert {k: v["size"] for k, v in router_doc["pools"].items()} == {"prefill": 2, "decode": 2}
    assert set(router_doc["queues"]) == {"prefill", "decode"}
    for w in [*router_doc["prefill"].values(), *router_doc["decode"].values()]:
        assert w["node_ip"] and w["device"] == "cpu" and w["num_blocks"] > 0
    assert any(q["num_transfers"] > 0 and q["live_gbps"] > 0 for q in router_doc["kv_pairs"])

    assert main(["status", "--url", url]) == 0
    text = capsys.readouterr().out
    for line in ("pools", "workers", "KV pairs", "pdserve-prefill-0", "pdserve-decode-1"):
        assert line in text, text
    row = next(line for line in text.splitlines() if f"{src} -> {decode_id}" in line)
    assert "gloo" in row and "lease_expired" in row and "GB/s" in row, row
    print(text)  # for the record: the map of a real disaggregated run (pytest -s shows it)
    wait_no_leaks(router, timeout_s=30)
