"""Tenants (`--api-keys-file`, frontend/tenants.py): each key a tenant with its share, rate and prefix-cache
scope; the per-call token cap; the HTTP edges (body deadline, head deadline, connection cap)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from deployments.config import ServeConfig, ServeConfigError
from deployments.frontend.backend import LocalEngineBackend
from deployments.frontend.http_app import build_openai_app
from deployments.frontend.openai_protocol import APIError
from deployments.frontend.tenants import Tenant, TenantBook, TenantFileError
from deployments.http_limits import head_deadline_protocol
from engine import EngineConfig, LLMEngine

ALICE, BOB, CAROL = "sk-alice-0123", "sk-bob-456789", "sk-carol-9876"


def _book() -> TenantBook:
    return TenantBook([Tenant("alice", ALICE, max_requests=2), Tenant("bob", BOB, weight=2.0),
                       Tenant("carol", CAROL, share_prefix_cache=True, requests_per_s=0.001, burst=1)])


def _write(tmp_path, data) -> str:
    p = tmp_path / "keys.json"
    p.write_text(json.dumps(data))
    return str(p)


# ---------------------------------------------------------------------- the book
def test_the_keys_file_is_checked_entry_by_entry(tmp_path, monkeypatch):
    bad = [({"tenants": []}, "at least one tenant"),
           ({"tenants": [{"name": "a"}]}, "exactly one of key, key_env"),
           ({"tenants": [{"name": "a", "key": "short"}]}, "tenant 'a'.key"),
           ({"tenants": [{"name": "a", "key": "sk-long-enough", "weight": 0}]}, "tenant 'a'.weight"),
           ({"tenants": [{"name": "a", "key": "sk-long-enough", "max_requests": 1.5}]}, "'a'.max_requests"),
           ({"tenants": [{"name": "a", "key": "sk-long-enough", "colour": "red"}]}, "unknown field"),
           ({"tenants": [{"name": "a", "key": "sk-long-enough"}, {"name": "a", "key": "sk-other-key"}]}, "unique"),
           ({"tenants": [{"name": "a", "key_env": "PDSERVE_TEST_UNSET_KEY"}]}, "is the variable set")]
    for data, words in bad:
        with pytest.raises(TenantFileError, match=words.replace(".", r"\.").replace("(", r"\(")):
            TenantBook.from_file(_write(tmp_path, data))
    monkeypatch.setenv("PDSERVE_TEST_KEY", "sk-from-the-env")
    book = TenantBook.from_file(_write(tmp_path, {"tenants": [{"name": "a", "key_env": "PDSERVE_TEST_KEY"}]}))
    assert book.identify("Bearer sk-from-the-env").name == "a"
    with pytest.raises(ServeConfigError, match="api_keys_file"):
        ServeConfig(api_keys_file=str(tmp_path / "missing.json"))
    assert "sk-from-the-env" not in repr(book.tenants)  # keys never in reprs (logs)


def test_identify_admit_and_release():
    book = _book()
    assert book.identify(f"Bearer {ALICE}").name == "alice"
    assert book.identify(f"bearer {BOB}").name == "bob"
    assert book.identify("Bearer sk-nobody-0000") is None and book.identify(None) is None
    alice = book.identify(f"Bearer {ALICE}")
    a = book.admit(alice, 2, 100)
    with pytest.raises(APIError) as exc:
        book.admit(alice, 1, 10)
    assert exc.value.status_code == 429 and "max_requests" in exc.value.message and exc.value.headers["Retry-After"]
    a.release()
    a.release()  # idempotent
    assert book.in_flight("alice") == (0, 0)
    book.admit(alice, 1, 10).release()
    carol = book.identify(f"Bearer {CAROL}")
    book.admit(carol, 1, 1).release()  # the burst of one
    with pytest.raises(APIError, match="rate limit"):
        book.admit(carol, 1, 1)


def test_each_tenant_has_its_own_prefix_cache_scope_unless_it_shares():
    book = _book()
    alice, bob, carol = (book.identify(f"Bearer {k}") for k in (ALICE, BOB, CAROL))
    assert alice.salt_for(None) != bob.salt_for(None)
    assert alice.salt_for("x") != alice.salt_for(None) and alice.salt_for("x") != bob.salt_for("x")
    assert carol.salt_for(None) is None and carol.salt_for("x") == "x"


# ---------------------------------------------------------------------- through the HTTP app
@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine(EngineConfig(model=tiny_model_dir("llama"), block_size=4, max_model_len=256, num_threads=1,
                                  enable_prefix_caching=True))


@pytest.fixture(scope="module")
def backend(engine):
    be = LocalEngineBackend(engine)
    yield be
    be.shutdown()


@pytest.fixture
def app(engine, backend):
    return build_openai_app(backend, engine.tokenizer, "tiny", engine.max_model_len, tenants=_book(),
                            max_request_tokens=2000)


def _post(app, key: str | None, body: dict) -> httpx.Response:
    async def go():
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post("/v1/completions", json=body, headers=headers, timeout=60)
    return asyncio.run(go())


PROMPT = list(range(10, 34))  # 24 tokens: 5 full blocks of 4 can be cached


def test_keys_shares_and_the_call_cap_over_http(app):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2}
    assert _post(app, None, body).status_code == 401
    assert _post(app, "sk-nobody-0000", body).status_code == 401
    r = _post(app, ALICE, {**body, "n": 3})  # 3 requests against alice's max_requests of 2
    assert r.status_code == 429 and r.json()["error"]["code"] == "tenant_limit" and "Retry-After" in r.headers
    assert _post(app, ALICE, {**body, "n": 2}).status_code == 200
    assert _post(app, BOB, {**body, "n": 3}).status_code == 200  # bob has no cap
    r = _post(app, BOB, {**body, "n": 16, "max_tokens": 200})  # 16 x (24 + 200) > max_request_tokens 2000
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert app.state.pdserve.tenants.in_flight("alice") == (0, 0)


def test_cached_tokens_never_cross_tenants(app):
    body = {"model": "tiny", "prompt": [7, *PROMPT], "max_tokens": 1}
    first = _post(app, ALICE, body).json()["usage"]
    again = _post(app, ALICE, body).json()["usage"]
    other = _post(app, BOB, body).json()["usage"]
    cached = lambda u: (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)  # noqa: E731
    assert cached(first) == 0 and cached(again) > 0  # alice's own prefix is cached for alice
    assert cached(other) == 0  # bob learns nothing of what alice sent


def test_a_body_that_stalls_after_its_headers_is_a_408(app):
    app.state.pdserve.body_timeout_s = 0.2
    sent: list[dict] = []

    async def receive():
        await asyncio.sleep(3600)  # the client never sends its body

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "headers": [(b"authorization", f"Bearer {BOB}".encode()),
                                               (b"content-length", b"100")],
             "http_version": "1.1", "scheme": "http", "server": ("t", 80), "client": ("c", 1), "root_path": ""}

    async def go():
        async with asyncio.timeout(60):  # the test's own bound, far above the 0.2 s deadline
            await app(scope, receive, send)
    asyncio.run(go())
    assert sent[0]["status"] == 408


def test_a_connection_without_a_whole_head_is_closed(app):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", http=head_deadline_protocol(0.3),
                                           limit_concurrency=64))
    thread = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with socket.create_connection(("127.0.0.1", port), timeout=30) as half:
            half.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # and nothing more
            assert half.recv(1024) == b""  # the server closed it (recv's own timeout would raise)
        with socket.create_connection(("127.0.0.1", port), timeout=30) as ok:  # a whole request is served
            ok.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert ok.recv(1024).startswith(b"HTTP/1.1 200")
    finally:
        server.should_exit = True
        thread.join(10)


# ---------------------------------------------------------------------- the gRPC door
class _Ctx:
    def __init__(self, key: str | None):
        self.metadata = [("authorization", f"Bearer {key}")] if key else []
        self.code = None

    def invocation_metadata(self):
        return self.metadata

    def set_code(self, code):
        self.code = code

    def set_details(self, details):
        pass


def test_tenant_keys_and_shares_at_the_grpc_door(engine, backend):
    import grpc

    from deployments.frontend.grpc import pdserve_pb2
    from deployments.frontend.grpc_app import GenerationService, GRPCError, ServingState

    book = _book()
    service = GenerationService(ServingState(backend, engine.tokenizer, "tiny", engine.max_model_len,
                                             engine.vocab_size, "fcfs"), None, book, 2000)

    def call(key, **fields):
        async def run():
            return [c async for c in service.Generate(pdserve_pb2.GenerateRequest(**fields), _Ctx(key))]
        try:
            return asyncio.run(run())
        except GRPCError as e:
            return e

    req = dict(prompt_token_ids=PROMPT, max_tokens=2, ignore_eos=True)
    assert call(None, **req).code == grpc.StatusCode.UNAUTHENTICATED
    assert call(ALICE, **req, n=3).code == grpc.StatusCode.RESOURCE_EXHAUSTED  # alice's max_requests is 2
    assert call(ALICE, **req, n=2)[-1].usage.completion_tokens == 4
    assert call(BOB, prompt_token_ids=PROMPT, max_tokens=500, n=4).code == grpc.StatusCode.INVALID_ARGUMENT
    assert book.in_flight("alice") == (0, 0)
