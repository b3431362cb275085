"""`pdserve serve --layout disagg` on a CPU host: a prefill pool and a decode pool with the KV moving
between them over gloo, started as a user starts it; the start line maps the processes, and a chat
request through the prefill worker and the KV transfer answers as one engine does."""

from __future__ import annotations


import json
import os
import subprocess
import sys

import httpx
import jsonschema
import pytest

from helpers import served_cli

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def served():
    # local_prefill_max_tokens 0: every prompt goes through the prefill pool and its KV moves.
    with served_cli(["--layout", "disagg", "--dtype", "float32", "--max-num-seqs", "8", "--kv-cache-memory-mb",
                     "64", "--local-prefill-max-tokens", "0"], ready_timeout_s=420) as server:
        yield server


def test_the_start_line_maps_the_pools_and_the_transport(served):
    _, _, lines = served
    assert any(line.strip() == "pdserve: layout=disagg  ingress(1) -> router(1) -> prefill(1, cpu) =gloo=> "
               "decode(1, cpu)" for line in lines), lines


def test_a_chat_request_goes_through_the_prefill_pool_and_the_kv_transfer(served):
    url, _, _ = served
    r = httpx.post(f"{url}/v1/chat/completions", timeout=120,
                   json={"model": "SmolLM2-135M-Instruct", "messages": FRANCE, "temperature": 0, "max_tokens": 16})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "The capital of France is Paris."
    counters = httpx.get(f"{url}/health", timeout=30).json()["router"]["counters"]
    # Admitted into the decode worker after a prefill elsewhere, none prefilled where it decodes.
    assert counters["admitted"] >= 1 and counters["local_prefills"] == 0, counters


PERSON = {"type": "object", "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.mark.parametrize("stream", [False, True])
def test_a_schema_constrained_answer_continues_its_grammar_after_the_kv_transfer(served, stream):
    # The prefill worker samples the first token under the grammar; the decode worker, after the KV
    # moved, must go on from that token's grammar state, or the JSON breaks at the seam.
    url, _, _ = served
    before = httpx.get(f"{url}/health", timeout=30).json()["router"]["counters"]
    body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Invent a person."}],
            "temperature": 1.5, "seed": 7, "max_tokens": 60, "stream": stream,
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}}
    if not stream:
        r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        text, finish = choice["message"]["content"], choice["finish_reason"]
    else:
        parts, finish = [], None
        with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=120, json=body) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    for c in json.loads(line[6:])["choices"]:
                        parts.append(c["delta"].get("content") or "")
                        finish = c.get("finish_reason") or finish
        text = "".join(parts)
    assert finish == "stop", (finish, text)
    jsonschema.validate(json.loads(text), PERSON)
    after = httpx.get(f"{url}/health", timeout=30).json()["router"]["counters"]
    assert after["admitted"] > before["admitted"] and after["local_prefills"] == before["local_prefills"], after


_JOIN = """import sys, ray
try:
    ray.init(address=sys.argv[1])
    print("JOINED")
except Exception as exc:  # the refusal, whatever Ray wraps it in
    print("REFUSED", exc)
"""


def test_a_client_without_the_ray_token_is_refused(served):
    # The cluster `pdserve serve` started keeps Ray's token authentication on: a client that joins
    # without the token is turned away by the GCS before it can run anything.
    _, _, lines = served
    line = next(ln for ln in lines if ln.startswith("pdserve: Ray at "))
    assert "token authentication on" in line, line
    address = line.split("Ray at ", 1)[1].split(",", 1)[0]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env["RAY_AUTH_MODE"] = "disabled"  # a client that sends no token
    out = subprocess.run([sys.executable, "-c", _JOIN, address], env=env, capture_output=True, text=True,
                         timeout=180)
    assert "REFUSED" in out.stdout and "JOINED" not in out.stdout, (out.stdout, out.stderr[-2000:])
    assert "InvalidAuthToken" in out.stdout + out.stderr, (out.stdout, out.stderr[-2000:])

