"""The OpenAI ingress over a LocalEngineBackend (real SmolLM2, no Ray), driven by the real `openai` client
against uvicorn on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from typing import AsyncIterator

import httpx
import openai
import pytest
import torch
import uvicorn

from deployments.frontend.backend import LocalEngineBackend, QueueFullError, TokenDelta
from deployments.frontend.http_app import build_openai_app, configure_openai_app
from deployments.frontend.text_stream import IncrementalDetokenizer, StopStringFilter
from engine import EngineConfig, LLMEngine, SamplingParams
from helpers import read_until_every_choice

MODEL = "smollm2"
API_KEY = "sekret"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
EOS_OFF = {"ignore_eos": True}  # a vLLM-style extension, sent through the client's extra_body


# ---------------------------------------------------------------------- fixtures
class _Server:
    """uvicorn serving `app` on a free port in a daemon thread."""

    def __init__(self, app):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, kwargs=dict(sockets=[sock]), daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)

    def client(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=60)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(model=None, num_threads=2))


@pytest.fixture(scope="module")
def backend(engine):
    be = LocalEngineBackend(engine)
    yield be
    be.shutdown()


@pytest.fixture(scope="module")
def server(engine, backend):
    srv = _Server(build_openai_app(backend, engine.tokenizer, MODEL, engine.max_model_len))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def offline(backend: LocalEngineBackend, prompt_ids: list[int], params: SamplingParams):
    """The engine alone (add_request + step loop), run on the backend's engine thread."""
    def run(eng: LLMEngine):
        eng.add_request("offline", prompt_ids, params)
        while True:
            for out in eng.step():
                if out.request_id == "offline" and out.finished:
                    return out
    return backend.run_on_engine(run).result(timeout=120)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def wait_drained(backend: LocalEngineBackend, timeout_s: float = 10.0) -> None:
    """Until the engine holds no request; then its KV cache must be whole and empty."""
    deadline = time.monotonic() + timeout_s
    while True:
        busy = backend.run_on_engine(lambda e: e.has_unfinished_requests()).result(timeout=30)
        if not busy and backend.num_requests == 0:
            break
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.05)

    def check(e: LLMEngine) -> int:
        e.check_integrity()
        return e.block_manager.num_used_blocks

    assert backend.run_on_engine(check).result(timeout=30) == 0


# ---------------------------------------------------------------------- outputs match the engine
def test_chat_matches_offline_engine(engine, backend, client):
    ref = offline(backend, engine.apply_chat_template(FRANCE), greedy(engine.max_model_len - 64))
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.text
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    n_prompt = len(engine.apply_chat_template(FRANCE))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, len(ref.token_ids))
    assert r.usage.total_tokens == n_prompt + len(ref.token_ids)


def test_chat_stream_matches_offline_engine(engine, backend, client):
    ref = offline(backend, engine.apply_chat_template(FRANCE), greedy(engine.max_model_len - 64))
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=FRANCE, temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text and "Paris" in text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)
    assert all(c.usage is None for c in chunks[:-1])


@pytest.mark.parametrize("prompt", ["The three primary colors are", "def fibonacci(n):"])
def test_completions_match_offline_engine(engine, backend, client, prompt):
    ids = engine.encode_prompt(prompt)
    ref = offline(backend, ids, greedy(24, ignore_eos=True))
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, extra_body=EOS_OFF)
    assert r.id.startswith("cmpl-") and r.object == "text_completion"
    assert r.choices[0].text == ref.text
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), 24, len(ids) + 24)

    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                            extra_body=EOS_OFF, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == ref.text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])

    # Token ids in, same text out.
    r2 = client.completions.create(model=MODEL, prompt=ids, max_tokens=24, temperature=0, extra_body=EOS_OFF)
    assert r2.choices[0].text == ref.text


def test_usage_reports_prefix_cache_hits(engine, backend, client):
    """usage.prompt_tokens_details.cached_tokens: 0 for a prompt never seen, then every full block of it
    but the one holding the last token (always computed) when it comes again; same tokens either way."""
    ids = [int(t) for t in torch.randint(1000, 40000, (70,), generator=torch.Generator().manual_seed(1234))]
    bs = engine.config.block_size
    first = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0, extra_body=EOS_OFF)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    chunks = list(client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0, extra_body=EOS_OFF,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == (len(ids) - 1) // bs * bs
    assert "".join(c.choices[0].text for c in chunks if c.choices) == first.choices[0].text
    wait_drained(backend)


def test_concurrent_streams_each_match_offline(engine, backend, server):
    prompts = ["Water boils at", "The largest planet is", "My favourite food is"]
    refs = [offline(backend, engine.encode_prompt(p), greedy(16, ignore_eos=True)).text for p in prompts]
    results: dict[int, str] = {}

    def run(i: int) -> None:
        stream = server.client().completions.create(model=MODEL, prompt=prompts[i], max_tokens=16, temperature=0,
                                                    extra_body=EOS_OFF, stream=True)
        results[i] = "".join(c.choices[0].text for c in stream)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [results.get(i) for i in range(len(prompts))] == refs
    wait_drained(backend)


# ---------------------------------------------------------------------- stop strings
def test_stop_string_cuts_text_in_both_modes(engine, backend, client):
    prompt = "Here is a short story about a dragon:"
    full = offline(backend, engine.encode_prompt(prompt), greedy(40, ignore_eos=True)).text
    stop = full[12:17]  # five characters from the middle: usually spans a token boundary
    assert stop.strip() and len(full) > 20
    expected = full[:full.find(stop)]
    kw = dict(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, extra_body=EOS_OFF, stop=[stop, "@@@@"])
    r = client.completions.create(**kw)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (expected, "stop")
    chunks = list(client.completions.create(**kw, stream=True))
    pieces = [c.choices[0].text for c in chunks]
    assert "".join(pieces) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 40
    wait_drained(backend)


def test_stop_string_filter_holds_back_prefixes():
    f = StopStringFilter(["STOP", "xy"])
    assert f.feed("abc S") == ("abc ", False)  # "S" may start "STOP"
    assert f.feed("T") == ("", False)
    assert f.feed("x") == ("ST", False)  # "STx" cannot start "STOP"; "x" may start "xy"
    assert f.feed("z STO") == ("xz ", False)
    assert f.feed("Pend") == ("", True)
    g = StopStringFilter([])
    assert g.feed("anything") == ("anything", False)
    h = StopStringFilter(["END"])
    assert h.feed("the E") == ("the ", False) and h.flush() == "E"


def test_incremental_detokenizer_multibyte(engine):
    tok = engine.tokenizer
    text = "Grüße aus Köln 🎉🇫🇷 — 世界你好, naïve café. ∑x² ≤ π"
    ids = tok.encode(text, add_special_tokens=False)
    for direct in (True, False):  # SmolLM2's Rust tokenizer straight, and through transformers' wrapper
        detok = IncrementalDetokenizer(tok)
        assert detok._backend is not None
        if not direct:
            detok._backend = None
        pieces = [detok.push([t]) for t in ids] + [detok.flush()]
        assert "".join(pieces) == tok.decode(ids) == text
        assert not any("\ufffd" in p for p in pieces)
        assert sum(1 for p in pieces if p == "") > 0  # some tokens were partial characters and waited


# ---------------------------------------------------------------------- bad input
def _too_long(engine) -> list[int]:
    return [504] * engine.max_model_len


BAD_INPUTS = [
    # (name, path, body or raw bytes, status, param, code)
    ("n=17", "completions", {"prompt": "hi", "n": 17}, 400, "n", None),
    ("temperature<0", "completions", {"prompt": "hi", "temperature": -1}, 400, "temperature", None),
    ("top_p=0", "chat/completions", {"messages": FRANCE, "top_p": 0}, 400, "top_p", None),
    ("max_tokens=0", "completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", None),
    ("max_completion_tokens=0", "chat/completions", {"messages": FRANCE, "max_completion_tokens": 0}, 400,
     "max_completion_tokens", None),
    ("max_tokens too big", "completions", {"prompt": "hi", "max_tokens": 10**6}, 400, "max_tokens",
     "context_length_exceeded"),
    ("prompt too long", "completions", "TOO_LONG", 400, "prompt", "context_length_exceeded"),
    ("messages too long", "chat/completions", {"messages": [{"role": "user", "content": "hello " * 9000}]}, 400,
     "messages", "context_length_exceeded"),
    ("empty prompt", "completions", {"prompt": ""}, 400, "prompt", None),
    ("empty token prompt", "completions", {"prompt": []}, 400, "prompt", None),
    ("token id out of range", "completions", {"prompt": [1, 10**9]}, 400, "prompt", None),
    ("batched prompts, one empty", "completions", {"prompt": ["a", ""]}, 400, "prompt", None),
    ("65 batched prompts", "completions", {"prompt": ["a"] * 65}, 400, "prompt", None),
    ("no messages", "chat/completions", {"messages": []}, 400, "messages", None),
    ("missing messages", "chat/completions", {"model": MODEL}, 400, "messages", None),
    ("wrong type", "completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature", None),
    ("image content", "chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "messages", None),
    ("malformed JSON", "completions", b'{"prompt": "hi",', 400, None, "invalid_json"),
    ("not an object", "completions", b'[1, 2]', 400, None, None),
    ("unknown model", "completions", {"prompt": "hi", "model": "gpt-17"}, 404, "model", "model_not_found"),
    # Nothing is accepted and ignored: unknown fields, and known options this server lacks unless "off".
    ("unknown field", "completions", {"prompt": "hi", "max_token": 5}, 400, "max_token", "unknown_parameter"),
    ("presence_penalty", "completions", {"prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty",
     "invalid_value"),
    ("frequency_penalty", "chat/completions", {"messages": FRANCE, "frequency_penalty": -3}, 400,
     "frequency_penalty", "invalid_value"),
    ("logit_bias", "chat/completions", {"messages": FRANCE, "logit_bias": {"504": -101}}, 400, "logit_bias",
     "invalid_value"),
    ("logit_bias id", "completions", {"prompt": "hi", "logit_bias": {"999999999": 1}}, 400, "logit_bias",
     "invalid_value"),
    ("logit_bias key", "completions", {"prompt": "hi", "logit_bias": {"a": 1}}, 400, "logit_bias",
     "invalid_value"),
    ("response_format bad schema", "chat/completions", {"messages": FRANCE, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}}, 400, "response_format",
     "invalid_value"),
    ("response_format on completions", "completions", {"prompt": "hi", "response_format": {"type": "xml"}}, 400,
     "response_format", "invalid_value"),
    ("chat logprobs not a bool", "chat/completions", {"messages": FRANCE, "logprobs": 1}, 400, "logprobs", None),
    ("completion logprobs", "completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs", "invalid_value"),
    ("top_logprobs", "chat/completions", {"messages": FRANCE, "top_logprobs": 2}, 400, "top_logprobs",
     "invalid_value"),
    ("completion top_logprobs", "completions", {"prompt": "hi", "top_logprobs": 2}, 400, "top_logprobs",
     "unsupported_parameter"),
    ("chat echo", "chat/completions", {"messages": FRANCE, "echo": True}, 400, "echo", "unsupported_parameter"),
    ("max_tokens=0 with echo and min_tokens", "completions", {"prompt": "hi", "echo": True, "max_tokens": 0,
                                                              "min_tokens": 1}, 400, "min_tokens", None),
    ("suffix", "completions", {"prompt": "hi", "suffix": "x"}, 400, "suffix", "unsupported_parameter"),
    ("best_of", "completions", {"prompt": "hi", "best_of": 2}, 400, "best_of", "unsupported_parameter"),
    ("tools auto", "chat/completions", {"messages": FRANCE, "tools": [{"type": "function", "function": {"name": "f"}}]},
     400, "tool_choice", "invalid_value"),
    ("tools on completions", "completions", {"prompt": "hi", "tools": [{"type": "function", "function": {"name": "f"}}]},
     400, "tools", "unsupported_parameter"),
    ("tool_choice", "completions", {"prompt": "hi", "tool_choice": "auto"}, 400, "tool_choice",
     "unsupported_parameter"),
    ("min_p", "completions", {"prompt": "hi", "min_p": 1.1}, 400, "min_p", "invalid_value"),
    ("repetition_penalty", "completions", {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty",
     "invalid_value"),
    ("guided_json", "chat/completions", {"messages": FRANCE, "guided_json": "{not json"}, 400, "guided_json",
     "invalid_value"),
    ("penalty false is not 0", "completions", {"prompt": "hi", "presence_penalty": False}, 400, "presence_penalty",
     "invalid_value"),
    ("message name", "chat/completions", {"messages": [{"role": "user", "content": "hi", "name": "bob"}]}, 400,
     "messages", "unsupported_parameter"),
    ("message extra field", "chat/completions", {"messages": [{"role": "user", "content": "hi", "x": 1}]}, 400,
     "messages", None),
    ("stream_options extra", "completions", {"prompt": "hi", "stream": True, "stream_options": {"x": 1}}, 400,
     "stream_options", None),
    ("max_tokens differs", "chat/completions", {"messages": FRANCE, "max_tokens": 5, "max_completion_tokens": 6},
     400, "max_tokens", None),
    # Numbers: JSON types exactly, finite, in range.
    ("NaN", "completions", b'{"prompt": "hi", "temperature": NaN}', 400, None, "invalid_json"),
    ("Infinity", "completions", b'{"prompt": "hi", "top_p": -Infinity}', 400, None, "invalid_json"),
    ("1e999 is inf", "completions", {"prompt": "hi", "temperature": float("inf")}, 400, None, "invalid_json"),
    ("1e999 literal", "completions", b'{"prompt": "hi", "temperature": 1e999}', 400, "temperature", None),
    ("temperature>100", "completions", {"prompt": "hi", "temperature": 100.5}, 400, "temperature", None),
    ("top_k too big", "completions", {"prompt": "hi", "top_k": 2**20 + 1}, 400, "top_k", None),
    ("top_k<-1", "completions", {"prompt": "hi", "top_k": -2}, 400, "top_k", None),
    ("seed 2**64", "completions", {"prompt": "hi", "seed": 2**64}, 400, "seed", None),
    ("seed below -2**63", "completions", {"prompt": "hi", "seed": -2**63 - 1}, 400, "seed", None),
    ("integer too long to parse", "completions", b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", 400, None,
     "invalid_json"),
    ("huge max_tokens", "completions", {"prompt": "hi", "max_tokens": 10**300}, 400, "max_tokens",
     "context_length_exceeded"),
    ("bool as int", "completions", {"prompt": "hi", "max_tokens": True}, 400, "max_tokens", None),
    ("float as int", "completions", {"prompt": "hi", "max_tokens": 5.0}, 400, "max_tokens", None),
    ("string as float", "completions", {"prompt": "hi", "temperature": "0.5"}, 400, "temperature", None),
    ("n=0", "completions", {"prompt": "hi", "n": 0}, 400, "n", None),
    ("min_tokens<0", "completions", {"prompt": "hi", "min_tokens": -1}, 400, "min_tokens", None),
    ("priority 2**31", "completions", {"prompt": "hi", "priority": 2**31}, 400, "priority", None),
    ("priority below -2**31", "completions", {"prompt": "hi", "priority": -2**31 - 1}, 400, "priority", None),
    # Lists and strings: bounded.
    ("17 stop strings", "completions", {"prompt": "hi", "stop": [f"s{i}" for i in range(17)]}, 400, "stop", None),
    ("long stop string", "completions", {"prompt": "hi", "stop": "x" * 513}, 400, "stop", None),
    ("empty stop string", "completions", {"prompt": "hi", "stop": [""]}, 400, "stop", None),
    ("stop_token_ids outside the vocabulary", "completions", {"prompt": "hi", "stop_token_ids": [10**6]}, 400,
     "stop_token_ids", None),
    ("negative stop_token_ids", "completions", {"prompt": "hi", "stop_token_ids": [-1]}, 400, "stop_token_ids", None),
    ("65 stop_token_ids", "completions", {"prompt": "hi", "stop_token_ids": list(range(65))}, 400, "stop_token_ids",
     None),
    ("negative prompt id", "completions", {"prompt": [5, -1]}, 400, "prompt", None),
    ("empty cache_salt", "completions", {"prompt": "hi", "cache_salt": ""}, 400, "cache_salt", None),
    ("long cache_salt", "completions", {"prompt": "hi", "cache_salt": "s" * 1025}, 400, "cache_salt", None),
    ("17 metadata pairs", "completions", {"prompt": "hi", "metadata": {f"k{i}": "v" for i in range(17)}}, 400,
     "metadata", None),
    # Bodies that are not a JSON object of valid Unicode.
    ("deep nesting", "completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None, "invalid_json"),
    ("invalid UTF-8", "completions", b'{"prompt": "\xff\xfe"}', 400, None, "invalid_json"),
    ("lone surrogate", "completions", b'{"prompt": "a\\ud800b"}', 400, "prompt", None),
    ("lone surrogate in chat", "chat/completions",
     b'{"messages": [{"role": "user", "content": "\\udfff"}]}', 400, "messages", None),
    ("string body", "completions", b'"hi"', 400, None, "invalid_json"),
    ("null body", "completions", b"null", 400, None, "invalid_json"),
    ("empty body", "completions", b"", 400, None, "invalid_json"),
]


@pytest.mark.parametrize("name,path,body,status,param,code", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_gets_openai_error(engine, server, name, path, body, status, param, code):
    if body == "TOO_LONG":
        body = {"prompt": _too_long(engine)}
    if isinstance(body, dict):
        body = {"model": MODEL, **body} if "model" not in body and name != "missing messages" else body
        content = json.dumps(body).encode()
    else:
        content = body
    r = httpx.post(f"{server.url}/v1/{path}", content=content, headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    if status == 400:
        assert err["type"] == "invalid_request_error"
    # ... and the server keeps serving.
    assert httpx.get(f"{server.url}/v1/models", timeout=10).status_code == 200


def test_bad_input_through_openai_client_then_serving(client, backend):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=FRANCE, n=17)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi")
    with pytest.raises(openai.BadRequestError):  # stream=True still answers the status code
        list(client.completions.create(model=MODEL, prompt="hi", temperature=-1, stream=True))
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0, extra_body=EOS_OFF)
    assert r.usage.completion_tokens == 3
    wait_drained(backend)


def test_models_and_health(engine, client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    h = httpx.get(f"{server.url}/health", timeout=10)
    assert h.status_code == 200 and h.json()["status"] == "ok"
    assert h.json()["model"] == MODEL and "num_requests" in h.json()  # no key configured: details for all


def test_off_values_of_unimplemented_options_are_accepted(engine, backend, server):
    """What SDKs send as defaults (penalties 0, no logprobs, n=1, text format, ...) changes nothing."""
    base = {"model": MODEL, "prompt": "The three primary colors are", "max_tokens": 6, "temperature": 0,
            "ignore_eos": True}
    offs = {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "logprobs": None, "echo": False,
            "suffix": None, "best_of": 1, "n": 1, "user": "u-1", "metadata": {"team": "a"}, "min_p": 0,
            "repetition_penalty": 1.0, "response_format": {"type": "text"}, "tools": [], "tool_choice": "none",
            "stream": False, "seed": None, "stop": None, "guided_json": None, "skip_special_tokens": True}
    plain = httpx.post(f"{server.url}/v1/completions", json=base, timeout=60)
    full = httpx.post(f"{server.url}/v1/completions", json={**base, **offs}, timeout=60)
    assert plain.status_code == full.status_code == 200, full.text
    assert full.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    chat = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "max_completion_tokens": 4, "max_tokens": 4, "logprobs": False, "top_logprobs": 0,
        "parallel_tool_calls": True, "stream_options": None, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
            {"role": "assistant", "content": "Hello!", "tool_calls": [], "refusal": None, "function_call": None},
            {"role": "user", "content": "Bye", "name": None}]})
    assert chat.status_code == 200, chat.text
    wait_drained(backend)


def test_body_size_is_bounded(engine, server):
    """413 from the declared length, and from the bytes read when no length is declared (chunked)."""
    big = json.dumps({"model": MODEL, "prompt": "x" * (4 * 1024 * 1024)}).encode()
    r = httpx.post(f"{server.url}/v1/completions", content=big, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text

    def chunked():
        for i in range(0, len(big), 1 << 16):
            yield big[i:i + (1 << 16)]

    r = httpx.post(f"{server.url}/v1/chat/completions", content=chunked(), timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
    assert httpx.get(f"{server.url}/v1/models", timeout=10).status_code == 200


def _stream_beside(server, send_big, baseline_tokens: int = 8):
    """A greedy stream; once it has `baseline_tokens` chunks (its own pace, unloaded), `send_big` runs on
    a thread. Returns (arrival times, the pace before the big request: median gap, (t0, t1, its result))."""
    body = {"model": MODEL, "prompt": "Count to one thousand:", "max_tokens": 400, "ignore_eos": True,
            "temperature": 0, "stream": True}
    arrivals: list[float] = []
    answer: list = []

    def big() -> None:
        t0 = time.monotonic()
        result = send_big()
        answer.append((t0, time.monotonic(), result))

    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as r:
        thread = None
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            arrivals.append(time.monotonic())
            if len(arrivals) == baseline_tokens + 1:
                thread = threading.Thread(target=big)
                thread.start()
            if answer and arrivals[-1] > answer[0][1] + 0.5:
                break  # enough seen after the big one was answered
        thread.join(120)
    gaps = sorted(b - a for a, b in zip(arrivals[:baseline_tokens], arrivals[1:baseline_tokens + 1]))
    return arrivals, gaps[len(gaps) // 2], answer[0]


def _assert_kept_pace(arrivals: list[float], pace: float, t0: float, t1: float) -> None:
    """Structural, against the stream's own pace measured in the same test (no fixed time bound): while
    the big request was being handled, the stream went on delivering tokens through the window; a
    blocked event loop would have delivered none for the whole window. Only judged when the window
    spans many tokens of the stream's own pace.

    NOTE: not a throughput bound: on 2 cores the big request's preparation (a worker thread) takes CPU
    from the engine, so the stream may slow down several times (28 tokens where its pace said 116, on a
    CI-like host); the gaps are measured by benchmarks/ingress_stall.py on an idle host."""
    end = min(t1, arrivals[-1])
    expected = (end - t0) / pace
    if expected < 8:
        return  # too short a window to tell a stall from the stream's own pace
    during = [t for t in arrivals if t0 < t <= end]
    gaps = [b - a for a, b in zip([t0, *during], [*during, end])]
    assert len(during) >= 3, f"{len(during)} tokens in {end - t0:.2f}s; the stream's pace says {expected:.0f}"
    assert max(gaps) < (end - t0) / 2, f"the stream stalled {max(gaps):.2f}s of the {end - t0:.2f}s"


def test_a_long_prompt_does_not_stall_other_streams(engine, backend, server):
    """A 4 MiB prompt is tokenized off the event loop (it takes seconds): a stream running meanwhile
    keeps its own pace (judged against itself, benchmarks/ingress_stall.py measures the gaps), and the
    long prompt gets its 400."""
    def post_big():
        return httpx.post(f"{server.url}/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": "hello world, this is text " * 160_000})

    arrivals, pace, (t0, t1, r) = _stream_beside(server, post_big)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    _assert_kept_pace(arrivals, pace, t0, t1)
    wait_drained(backend)


def test_health_answers_while_a_large_body_is_prepared(engine, backend, server):
    """A chat body made large by a field other than `content` (a multi-MB role) is prepared off
    the event loop: /health, asked after the big body was sent, is answered before it (a blocked loop
    answers in arrival order), and a stream running meanwhile keeps its pace."""
    big_body = {"model": MODEL, "max_tokens": 2,
                "messages": [{"role": "user" + " x" * 1_500_000, "content": "hi"}]}
    health: list[float] = []

    def post_big():
        done = threading.Event()

        def ask_health():
            # NOTE: the big body has to be on its way first: /health goes once its upload finished
            assert sent.wait(60)
            httpx.get(f"{server.url}/health", timeout=120)
            health.append(time.monotonic())
            done.set()

        sent = threading.Event()
        asker = threading.Thread(target=ask_health)
        asker.start()
        content = json.dumps(big_body).encode()

        def body_then_signal():
            yield content
            sent.set()
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, content=body_then_signal(),
                       headers={"content-type": "application/json"})
        answered = time.monotonic()
        asker.join(120)
        return r, answered

    arrivals, pace, (t0, t1, (r, answered)) = _stream_beside(server, post_big)
    assert r.status_code in (200, 400), r.text[:300]
    assert health and health[0] < answered, (f"/health waited for the large body's preparation: {r.status_code} "
                                              f"{r.text[:200]} answered {answered - t0:.2f}s, health {health[0] - t0:.2f}s")
    _assert_kept_pace(arrivals, pace, t0, t1)
    wait_drained(backend)


def test_cache_salt_separates_prefix_cache_entries(engine, backend, client):
    """Same prompt: a hit only under the same salt (or, unsalted, with the unsalted)."""
    ids = [int(t) for t in torch.randint(1000, 40000, (70,), generator=torch.Generator().manual_seed(4321))]
    bs = engine.config.block_size

    def cached(salt: str | None) -> int:
        extra = {**EOS_OFF, **({} if salt is None else {"cache_salt": salt})}
        r = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0, extra_body=extra)
        return r.usage.prompt_tokens_details.cached_tokens

    full_hit = (len(ids) - 1) // bs * bs
    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0 and cached(None) == 0
    assert cached("tenant-a") == cached("tenant-b") == cached(None) == full_hit
    wait_drained(backend)


def test_unknown_route_is_openai_404(server):
    r = httpx.get(f"{server.url}/v1/nothing-here", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


# ---------------------------------------------------------------------- auth
@pytest.fixture(scope="module")
def auth_server(engine, backend):
    srv = _Server(build_openai_app(backend, engine.tokenizer, MODEL, engine.max_model_len, api_key=API_KEY))
    yield srv
    srv.stop()


def test_api_key(auth_server, backend):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.post(f"{auth_server.url}/v1/completions", json=body, headers=headers, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{auth_server.url}/v1/models", timeout=10).status_code == 401
    # /health: up or not for anyone, the backend's details only with the key.
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        h = httpx.get(f"{auth_server.url}/health", headers=headers, timeout=10)
        assert h.status_code == 200 and h.json() == {"status": "ok"}
    h = httpx.get(f"{auth_server.url}/health", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10)
    assert h.status_code == 200 and h.json()["status"] == "ok" and "num_requests" in h.json()
    with pytest.raises(openai.AuthenticationError):
        auth_server.client("wrong").models.list()
    r = auth_server.client(API_KEY).completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body=EOS_OFF)
    assert r.usage.completion_tokens == 2


# ---------------------------------------------------------------------- backend refusals and failures
class _FakeBackend:
    """Scripted backend: raise before the first event, or yield `deltas` then stop."""

    def __init__(self, raise_first: Exception | None = None, deltas: list[TokenDelta] | None = None):
        self.raise_first = raise_first
        self.deltas = deltas or []
        self.aborted: list[str] = []

    async def generate(self, request_id, prompt_token_ids, params, priority=0) -> AsyncIterator[TokenDelta]:
        if self.raise_first is not None:
            raise self.raise_first
        for d in self.deltas:
            yield TokenDelta(list(d.token_ids), d.finished, d.finish_reason, d.error, len(prompt_token_ids))

    async def abort(self, request_id):
        self.aborted.append(request_id)

    async def health(self):
        return {"status": "ok"}


def _fake_server(engine, fake) -> _Server:
    return _Server(build_openai_app(fake, engine.tokenizer, MODEL, engine.max_model_len))


def test_queue_full_is_429_with_retry_after(engine):
    srv = _fake_server(engine, _FakeBackend(raise_first=QueueFullError("busy", retry_after_s=2.5)))
    try:
        for stream in (False, True):
            r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=10,
                           json={"model": MODEL, "messages": FRANCE, "stream": stream})
            assert r.status_code == 429 and r.headers["retry-after"] == "3"
            assert r.json()["error"]["code"] == "rate_limit_exceeded"
        with pytest.raises(openai.RateLimitError):
            srv.client().completions.create(model=MODEL, prompt="hi")
    finally:
        srv.stop()


def test_backend_error_midstream_is_sse_error_then_done(engine, caplog):
    hello = engine.tokenizer.encode("Hello world", add_special_tokens=False)
    fake = _FakeBackend(deltas=[TokenDelta(hello), TokenDelta([], True, "error", "decode worker died")])
    srv = _fake_server(engine, fake)
    try:
        body = {"model": MODEL, "prompt": "hi", "stream": True}
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=10) as r:
            assert r.status_code == 200
            events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[0])["choices"][0]["text"] == "Hello world"
        # The backend's reason (internal text) goes to the log; the client gets a generic message.
        err = json.loads(events[-2])["error"]
        assert err["code"] == "generation_failed" and err["type"] == "server_error"
        assert "decode worker died" not in err["message"] and "the server log has the cause" in err["message"]
        with pytest.raises(openai.APIError, match="generation failed for request cmpl-"):
            list(srv.client().completions.create(model=MODEL, prompt="hi", stream=True))
        r = httpx.post(f"{srv.url}/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=10)
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert r.json()["error"]["code"] == "generation_failed" and "decode worker died" not in r.text
        assert "decode worker died" in caplog.text  # ... where the operator finds it
    finally:
        srv.stop()


# ---------------------------------------------------------------------- client disconnects
def test_streaming_client_disconnect_aborts_request(engine, backend, server):
    wait_drained(backend)
    body = {"model": MODEL, "prompt": "Count to one thousand:", "max_tokens": 2000, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [line for line, _ in zip(lines, range(6)) if line.startswith("data: ")]
        assert got
        steps_before = backend.num_steps
    # Closed after a few chunks with ~2000 tokens to go.
    wait_drained(backend, timeout_s=5)
    assert backend.num_steps - steps_before < 200


def test_non_streaming_client_disconnect_aborts_request(engine, backend, server):
    wait_drained(backend)
    body = {"model": MODEL, "prompt": "Count to one thousand:", "max_tokens": 2000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=httpx.Timeout(10, read=1.0))
    wait_drained(backend, timeout_s=5)


@pytest.mark.parametrize("stream", [True, False])
def test_a_fan_out_client_that_disconnects_has_every_sequence_aborted(engine, backend, server, stream):
    # 2 prompts x n=3, 2000 tokens each: the six sequences end when the client goes, not at max_tokens.
    wait_drained(backend)
    body = {"model": MODEL, "prompt": ["Count to one thousand:", "List every prime:"], "n": 3, "max_tokens": 2000,
            "ignore_eos": True, "temperature": 1.0, "stream": stream}
    if stream:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as r:
            assert len(read_until_every_choice(r, 6)) == 6
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/v1/completions", json=body, timeout=httpx.Timeout(10, read=2.0))
    wait_drained(backend, timeout_s=5)


@pytest.mark.parametrize("num_chunks", [0, 3])
def test_cancelled_handler_aborts_request(engine, backend, num_chunks):
    """Ray Serve cancels the handler task when its client goes: before or after the first chunk."""
    wait_drained(backend)
    app = build_openai_app(backend, engine.tokenizer, MODEL, engine.max_model_len)
    body = json.dumps({"model": MODEL, "prompt": "Count to one thousand:", "max_tokens": 2000,
                       "ignore_eos": True, "stream": True}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}

    async def drive() -> None:
        sent: asyncio.Queue = asyncio.Queue()
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            if messages:
                return messages.pop()
            await asyncio.Event().wait()  # the client never says goodbye; the task is cancelled instead

        task = asyncio.create_task(app(scope, receive, sent.put))
        if num_chunks == 0:
            await asyncio.sleep(0.01)
        n = 0
        while n < num_chunks:
            msg = await asyncio.wait_for(sent.get(), 30)
            n += msg["type"] == "http.response.body"
        assert backend.num_requests == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(drive())
    wait_drained(backend, timeout_s=5)


def test_app_built_empty_then_configured(engine, backend):
    app = build_openai_app()
    srv = _Server(app)
    try:
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "hi"}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
        assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 503
        configure_openai_app(app, backend=backend, tokenizer=engine.tokenizer, model_name=MODEL,
                             max_model_len=engine.max_model_len)
        r = srv.client().completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body=EOS_OFF)
        assert r.usage.completion_tokens == 2
        assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200
    finally:
        srv.stop()


class _NeverStartsBackend(_FakeBackend):
    async def generate(self, request_id, prompt_token_ids, params, priority=0) -> AsyncIterator[TokenDelta]:
        await asyncio.sleep(3600)
        yield TokenDelta([1])


class _BrokenBackend(_FakeBackend):
    async def generate(self, request_id, prompt_token_ids, params, priority=0) -> AsyncIterator[TokenDelta]:
        raise RuntimeError("secret internal detail at 0xdeadbeef")
        yield TokenDelta([1])


def test_unexpected_error_is_a_generic_500(engine):
    srv = _fake_server(engine, _BrokenBackend())
    try:
        for stream in (False, True):
            r = httpx.post(f"{srv.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "stream": stream},
                           timeout=10)
            assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
            assert "secret" not in r.text and "RuntimeError" not in r.text
    finally:
        srv.stop()


def test_queue_wait_limit_is_503_and_aborts(engine):
    fake = _NeverStartsBackend()
    srv = _Server(build_openai_app(fake, engine.tokenizer, MODEL, engine.max_model_len, max_queue_wait_s=0.3))
    try:
        t0 = time.monotonic()
        r = httpx.post(f"{srv.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "stream": True}, timeout=10)
        assert r.status_code == 503 and "retry-after" in r.headers
        assert r.json()["error"]["code"] == "queue_timeout"
        assert time.monotonic() - t0 < 3
        assert len(fake.aborted) == 1 and fake.aborted[0].startswith("cmpl-")
    finally:
        srv.stop()
