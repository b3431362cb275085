"""Ray Serve direct ingress (`pdserve serve --direct-ingress`): the ingress replica serves HTTP on the
app's port itself, Serve's proxy sits on another port. Same outputs as the offline engine through the
official openai client; a client that disconnects mid-stream still frees every block."""

from __future__ import annotations

import json

import httpx
import pytest
import ray
from openai import OpenAI
from ray import serve

from deployments.app import NAMESPACE, ROUTER_NAME, build_app
from deployments.config import ServeConfig, direct_ingress_env
from engine import EngineConfig, LLMEngine, SamplingParams
from helpers import free_port, local_serve, run_offline, wait_no_leaks

MODEL = "SmolLM2-135M-Instruct"
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def server():
    port, proxy_port = free_port(), free_port()
    # NOTE: Ray's processes read it at start: local_serve sets it before ray.init, restores it after.
    env = direct_ingress_env(port, ServeConfig().direct_ingress_ports(), ServeConfig().ingress_drain_s)
    with local_serve(3, http_port=proxy_port, env=env):
        serve.run(build_app({"num_prefill_workers": 0, "num_decode_workers": 1, "kv_cache_memory_mb": 64,
                             "max_num_seqs": 8}), name="pdserve", route_prefix="/")
        yield f"http://127.0.0.1:{port}", ray.get_actor(ROUTER_NAME, namespace=NAMESPACE)


def test_replica_serves_the_port_and_matches_offline(server):
    url, router = server
    engine = LLMEngine(EngineConfig(model=None, num_kv_blocks=64))
    want = run_offline(engine, [engine.apply_chat_template([{"role": "user", "content": QUESTION}])],
                       SamplingParams(max_tokens=16, temperature=0))[0].text
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120)
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                            max_tokens=16, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want
    body = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                          max_tokens=16, temperature=0)
    assert body.choices[0].message.content == want
    wait_no_leaks(router)


def test_disconnect_mid_stream_frees_blocks(server):
    url, router = server
    body = {"model": MODEL, "prompt": "Tell me a very long story", "max_tokens": 1000, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        n = 0
        for line in r.iter_lines():
            if line.startswith("data: {"):
                json.loads(line[6:])
                n += 1
            if n >= 5:
                break
    wait_no_leaks(router)
    counters = ray.get(router.stats.remote())["counters"]
    assert counters["aborted"] >= 1, counters
