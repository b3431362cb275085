"""Ray Serve direct ingress (`pdserve serve --direct-ingress`): the ingress replica serves HTTP on the
app's port itself, Serve's proxy sits on another port. Same outputs as the offline engine through the
official openai client; a client that disconnects mid-stream still frees every block."""

from __future__ import annotations

import json
import os
import socket
import time

import httpx
import pytest
import ray
from openai import OpenAI
from ray import serve

from deployments.app import NAMESPACE, ROUTER_NAME, build_app, shutdown_router
from deployments.config import ServeConfig, direct_ingress_env
from engine import EngineConfig, LLMEngine, SamplingParams

MODEL = "SmolLM2-135M-Instruct"
QUESTION = "What is the capital of France?"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    port, proxy_port = _free_port(), _free_port()
    saved = dict(os.environ)
    # NOTE: Ray's processes read it at start: set before ray.init, restored after (other modules' Rays).
    os.environ.update(direct_ingress_env(port, ServeConfig().direct_ingress_ports()))
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": proxy_port})
        serve.run(build_app({"num_prefill_workers": 0, "num_decode_workers": 1, "kv_cache_memory_mb": 64,
                             "max_num_seqs": 8}), name="pdserve", route_prefix="/")
        yield f"http://127.0.0.1:{port}", ray.get_actor(ROUTER_NAME, namespace=NAMESPACE)
    finally:
        serve.shutdown()
        shutdown_router()
        ray.shutdown()
        os.environ.clear()
        os.environ.update(saved)


def _no_leaks(router, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        use = ray.get(router.check_integrity.remote(), timeout=30)
        if all(u["num_used_blocks"] == 0 and u["num_requests"] == 0 for u in use.values()):
            return
        assert time.monotonic() < deadline, f"blocks still held: {use}"
        time.sleep(0.2)


def test_replica_serves_the_port_and_matches_offline(server):
    url, router = server
    engine = LLMEngine(EngineConfig(model=None, num_kv_blocks=64))
    engine.add_request("ref", engine.apply_chat_template([{"role": "user", "content": QUESTION}]),
                       SamplingParams(max_tokens=16, temperature=0))
    want = None
    while engine.has_unfinished_requests():
        want = next((o.text for o in engine.step() if o.finished), want)
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120)
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                            max_tokens=16, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want
    body = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                          max_tokens=16, temperature=0)
    assert body.choices[0].message.content == want
    _no_leaks(router)


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
    _no_leaks(router)
    counters = ray.get(router.stats.remote())["counters"]
    assert counters["aborted"] >= 1, counters
