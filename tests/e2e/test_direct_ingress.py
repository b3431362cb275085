"""Ray Serve direct ingress (`pdserve serve --direct-ingress`, what `pdserve serve` picks with one
ingress replica): the ingress replica serves HTTP on the app's port itself, Serve's proxy sits on
another port. Through this colocated Ray layout:

- the same outputs as the offline engine through the official openai client; a client that
  disconnects mid-stream still frees every block;
- tenants (`api_keys_file`): two tenants' keys served, an unknown key refused with the OpenAI error
  object, each tenant's prefix cache its own, a tenant's cap and the per-call cap answered 429 / 400
  as in the single-process layout (tests/deployments/test_tenants.py);
- the HTTP limits (`http_header_timeout_s`, `http_keepalive_timeout_s`, `http_limit_concurrency`)
  applied by the replica's own server (deployments/http_limits.py), measured against the settings.
"""

from __future__ import annotations

import http.client
import json
import random
import socket
import time
import uuid

import httpx
import pytest
import ray
from openai import OpenAI
from ray import serve

from deployments.app import NAMESPACE, ROUTER_NAME, build_app, build_grpc_app
from deployments.config import ServeConfig, direct_ingress_env
from engine import EngineConfig, LLMEngine, SamplingParams
from helpers import free_port, listening_ports, local_serve, run_offline, wait_for, wait_no_leaks

MODEL = "SmolLM2-135M-Instruct"
QUESTION = "What is the capital of France?"
SHARED_KEY = "sk-shared-0123"  # --api-key beside the keys file: valid, no tenant
ALICE, BOB = "sk-alice-0123", "sk-bob-456789"
# The head deadline well above keep-alive: a close soon after a response is keep-alive's, not the head's.
HEADER_S, KEEPALIVE_S, LIMIT = 6.0, 1.0, 8
MAX_REQUEST_TOKENS = 4000


@pytest.fixture(scope="module")
def ports() -> dict[str, int]:
    """The HTTP door's, Serve's proxy's, the gRPC proxy's (`--grpc-port`) and the first of the range
    Ray's direct ingress would take replicas' own gRPC ports from (DI_GRPC_PORTS of them)."""
    return {"http": free_port(), "proxy": free_port(), "grpc": free_port(), "di_grpc": _free_range(DI_GRPC_PORTS + 1)}


DI_GRPC_PORTS = 8


def _free_range(n: int) -> int:
    """The first of `n` consecutive free ports below Linux's ephemeral range and above Ray's worker
    ports (10002-19999), where nothing of this test's own would bind by chance."""
    for base in random.Random().sample(range(20000, 32000, 16), 50):
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} free ports in a row")


@pytest.fixture(scope="module")
def server(tmp_path_factory, ports):
    keys = tmp_path_factory.mktemp("keys") / "api_keys.json"
    keys.write_text(json.dumps({"tenants": [{"name": "alice", "key": ALICE, "max_requests": 2},
                                            {"name": "bob", "key": BOB, "weight": 2}]}))
    # NOTE: Ray's processes read it at start: local_serve sets it before ray.init, restores it after.
    env = direct_ingress_env(ports["http"], ServeConfig().direct_ingress_ports(), ServeConfig().ingress_drain_s)
    env.update(RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT=str(ports["di_grpc"]),
               RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT=str(ports["di_grpc"] + DI_GRPC_PORTS))
    settings = {"num_prefill_workers": 0, "num_decode_workers": 1, "kv_cache_memory_mb": 64, "max_num_seqs": 8,
                "api_key": SHARED_KEY, "api_keys_file": str(keys), "max_request_tokens": MAX_REQUEST_TOKENS,
                "http_header_timeout_s": HEADER_S, "http_keepalive_timeout_s": KEEPALIVE_S,
                "http_limit_concurrency": LIMIT}
    with local_serve(3, http_port=ports["proxy"], grpc_port=ports["grpc"], env=env):
        serve.run(build_app(settings), name="pdserve", route_prefix="/")
        serve.run(build_grpc_app(settings), name="pdserve-grpc", route_prefix="/pdserve-grpc")
        yield f"http://127.0.0.1:{ports['http']}", ray.get_actor(ROUTER_NAME, namespace=NAMESPACE)


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_replica_serves_the_port_and_matches_offline(server):
    url, router = server
    engine = LLMEngine(EngineConfig(model=None, num_kv_blocks=64))
    want = run_offline(engine, [engine.apply_chat_template([{"role": "user", "content": QUESTION}])],
                       SamplingParams(max_tokens=16, temperature=0))[0].text
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    client = OpenAI(base_url=f"{url}/v1", api_key=SHARED_KEY, timeout=120)
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                            max_tokens=16, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want
    body = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                          max_tokens=16, temperature=0)
    assert body.choices[0].message.content == want
    wait_no_leaks(router)


def test_grpc_goes_through_its_proxy_and_no_replica_opens_a_grpc_server_of_its_own(server, ports):
    """With gRPC on, Serve's direct ingress would open a gRPC server in each ingress replica (every
    interface, from RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT): pdserve's replicas open none, and
    `pdserve.Generation` answers on the gRPC proxy's port, with the same keys as HTTP."""
    import grpc

    from deployments.frontend.grpc import pdserve_pb2, pdserve_pb2_grpc

    url, router = server
    req = pdserve_pb2.GenerateRequest(messages=[pdserve_pb2.ChatMessage(role="user", content=QUESTION)],
                                      max_tokens=16, temperature=0)
    with grpc.insecure_channel(f"127.0.0.1:{ports['grpc']}") as channel:
        stub = pdserve_pb2_grpc.GenerationStub(channel)
        meta = (("application", "pdserve-grpc"),)
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(req, metadata=meta, timeout=120))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        chunks = list(stub.Generate(req, metadata=(*meta, ("authorization", f"Bearer {SHARED_KEY}")), timeout=120))
    body = httpx.post(f"{url}/v1/chat/completions", headers=_auth(SHARED_KEY), timeout=120, json={
        "model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 16, "temperature": 0})
    assert "".join(c.text for c in chunks) == body.json()["choices"][0]["message"]["content"]
    open_ports = listening_ports()
    assert ports["grpc"] in open_ports and ports["http"] in open_ports
    assert not open_ports & set(range(ports["di_grpc"], ports["di_grpc"] + DI_GRPC_PORTS + 1))
    wait_no_leaks(router)


def test_disconnect_mid_stream_frees_blocks(server):
    url, router = server
    body = {"model": MODEL, "prompt": "Tell me a very long story", "max_tokens": 1000, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=_auth(SHARED_KEY), timeout=60) as r:
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


# ---------------------------------------------------------------------- tenants
def _cached(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text
    return (r.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def test_tenants_keys_prefix_scopes_and_caps(server):
    url, router = server

    def post(key: str, **fields) -> httpx.Response:
        return httpx.post(f"{url}/v1/completions", json={"model": MODEL, **fields}, headers=_auth(key), timeout=120)

    # A prompt no other test sent: 3+ blocks of 16 tokens that only these calls can have cached.
    prompt = f"Note {uuid.uuid4().hex}: " + "the quick brown fox jumps over the lazy dog. " * 6
    r = post("sk-nobody-0000", prompt=prompt, max_tokens=1)
    assert r.status_code == 401
    err = r.json()["error"]
    assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error" and err["message"]

    assert _cached(post(ALICE, prompt=prompt, max_tokens=1)) == 0
    assert _cached(post(ALICE, prompt=prompt, max_tokens=1)) > 0  # alice's own prefix, cached for alice
    assert _cached(post(BOB, prompt=prompt, max_tokens=1)) == 0  # bob learns nothing of what alice sent
    assert _cached(post(BOB, prompt=prompt, max_tokens=1)) > 0

    r = post(ALICE, prompt=prompt, max_tokens=1, n=3)  # 3 requests against alice's max_requests of 2
    assert r.status_code == 429 and r.json()["error"]["code"] == "tenant_limit" and int(r.headers["Retry-After"]) >= 1
    r = post(BOB, prompt=prompt, max_tokens=300, n=16)  # 16 x (prompt + 300) > max_request_tokens
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    assert post(ALICE, prompt=prompt, max_tokens=1, n=2).status_code == 200
    wait_no_leaks(router)


# ---------------------------------------------------------------------- the replica's HTTP limits
def _closed_after(sock: socket.socket, t0: float) -> float:
    """Seconds from `t0` until the server closed `sock` (its reads drained); the socket's own timeout
    raises if it never does."""
    while sock.recv(4096):
        pass
    return time.monotonic() - t0


def test_a_half_sent_head_is_closed_after_the_header_timeout(server):
    url, _ = server
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10 * HEADER_S) as half:
        t0 = time.monotonic()
        half.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # and nothing more
        waited = _closed_after(half, t0)
    # NOTE: Serve's own server (no head deadline) would hold it until the socket's timeout raised.
    assert waited >= 0.75 * HEADER_S, waited
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200  # a whole request is still served


def test_an_idle_keepalive_connection_is_closed_after_the_keepalive_timeout(server):
    url, _ = server
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10 * HEADER_S)
    try:
        conn.request("GET", "/health")
        r = conn.getresponse()
        assert r.status == 200 and not r.will_close
        r.read()
        t0 = time.monotonic()
        waited = _closed_after(conn.sock, t0)
    finally:
        conn.close()
    # Serve's default keep-alive is 90 s and the head deadline HEADER_S: closed before either, at the setting.
    assert 0.75 * KEEPALIVE_S <= waited < HEADER_S, waited


def _status(host: str, port: int) -> int:
    with socket.create_connection((host, port), timeout=30) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        head = s.recv(64)
    return int(head.split(b" ", 2)[1])


def test_connections_over_the_limit_are_answered_503(server):
    url, _ = server
    host, port = url.removeprefix("http://").split(":")
    idle = [socket.create_connection((host, int(port)), timeout=30) for _ in range(LIMIT)]
    try:
        assert _status(host, int(port)) == 503  # LIMIT connections open: one more is refused
    finally:
        for s in idle:
            s.close()
    wait_for(lambda: _status(host, int(port)), lambda code: code == 200, timeout_s=30, what="served again")
