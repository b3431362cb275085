"""Structured outputs and tool calls through the whole stack with the official openai client, colocated
(num_prefill_workers=0) and disaggregated (prefill pool → KV transfer → decode pool, where the decode
worker continues the grammar after the token the prefill worker sampled), streamed and not.

Every constrained answer must parse and validate (jsonschema), at temperature 0 and 1.5 (seeded); in a
concurrent sampled batch (n > 1, both endpoints, tool calls in parallel) every answer that ends with
"stop" / "tool_calls" validates and most of them end so (the rest: "length", cut by max_tokens).
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import openai
import pytest
import ray
from openai import OpenAI
from ray import serve

from deployments.app import NAMESPACE, ROUTER_NAME, build_app, build_grpc_app
from deployments.frontend.grpc import pdserve_pb2, pdserve_pb2_grpc
from helpers import free_port, local_serve, wait_no_leaks

MODEL = "SmolLM2-135M-Instruct"
LAYOUTS = {"colocated": {"num_prefill_workers": 0, "num_decode_workers": 1},
           "disaggregated": {"num_prefill_workers": 1, "num_decode_workers": 1}}
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pet": {"enum": ["cat", "dog", "fish"]}}, "required": ["name", "age", "pet"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 16},
                                                "unit": {"enum": ["celsius", "fahrenheit"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a timezone",
                                         "parameters": {"type": "object", "properties": {
                                             "tz": {"enum": ["UTC", "CET", "PST"]}}, "required": ["tz"]}}}
TOOL_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


# The disaggregated run is slow (its own cluster, every case again); tests/deployments/test_disagg_layout.py
# keeps a schema-constrained answer through the prefill pool and the KV transfer in the default run.
@pytest.fixture(scope="module", params=["colocated", pytest.param("disaggregated", marks=pytest.mark.slow)])
def server(request):
    gport = free_port()
    with local_serve(4, grpc_port=gport) as port:
        args = {**LAYOUTS[request.param], "kv_cache_memory_mb": 64, "max_num_seqs": 8}
        serve.run(build_app(args), name="pdserve", route_prefix="/")
        serve.run(build_grpc_app(args), name="pdserve-grpc", route_prefix="/pdserve-grpc")
        router = ray.get_actor(ROUTER_NAME, namespace=NAMESPACE)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=180)
        yield client, router, gport
        wait_no_leaks(router, timeout_s=30)


def chat(client: OpenAI, content: str, stream: bool, **kwargs):
    """(text, finish_reason) of one chat answer, streamed or not; extras go through extra_body."""
    known = {k: kwargs.pop(k) for k in ("response_format", "temperature", "seed", "tools", "tool_choice",
                                        "parallel_tool_calls") if k in kwargs}
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                       max_tokens=kwargs.pop("max_tokens", 60), stream=stream, extra_body=kwargs,
                                       **known)
    if not stream:
        return r.choices[0].message, r.choices[0].finish_reason
    return r, None


def text_of(client: OpenAI, content: str, stream: bool, **kwargs) -> str:
    r, finish = chat(client, content, stream, **kwargs)
    if not stream:
        assert finish == "stop", (finish, r.content)
        return r.content
    chunks = list(r)
    assert chunks[-1].choices[0].finish_reason == "stop", chunks[-1]
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


@pytest.mark.parametrize("stream", [False, True])
def test_json_object_parses(server, stream):
    client, _, _ = server
    out = text_of(client, "Give a JSON object with a cat's name and age.", stream,
                  response_format={"type": "json_object"}, temperature=0, max_tokens=120)
    assert isinstance(json.loads(out), (dict, list))


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("temperature", [0, 1.5])
def test_json_schema_validates(server, stream, temperature):
    client, _, _ = server
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for seed in (1, 2):
        out = text_of(client, "Invent a person with a pet.", stream, response_format=fmt, temperature=temperature,
                      seed=seed)
        jsonschema.validate(json.loads(out), PERSON)


@pytest.mark.parametrize("stream", [False, True])
def test_guided_regex_choice_and_grammar(server, stream):
    client, _, _ = server
    out = text_of(client, "Give a code.", stream, guided_regex=r"[A-Z]{2}-[0-9]{3}", temperature=1.5, seed=3)
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", out), out
    cities = ["Paris", "London", "Berlin"]
    assert text_of(client, "What is the capital of France?", stream, guided_choice=cities, temperature=0) in cities
    grammar = 'root ::= answer " " number\nanswer ::= "yes" | "no"\nnumber ::= [1-9] [0-9]?'
    out = text_of(client, "Is the sky blue? How sure are you?", stream, guided_grammar=grammar, temperature=1.5,
                  seed=4)
    assert re.fullmatch(r"(yes|no) [1-9][0-9]?", out), out
    assert text_of(client, "Yes or no?", stream, structured_outputs={"choice": ["yes", "no"]}, temperature=0) \
        in ("yes", "no")


def tool_calls_of(client: OpenAI, stream: bool, **kwargs) -> tuple[list[tuple[str, str, str]], str]:
    """[(id, name, arguments)] and the finish_reason, from the message or rebuilt from the deltas."""
    r, finish = chat(client, "What is the weather in Paris?", stream, tools=[WEATHER, TIME], max_tokens=80, **kwargs)
    if not stream:
        assert r.content is None
        return [(c.id, c.function.name, c.function.arguments) for c in r.tool_calls], finish
    calls: dict[int, list[str]] = {}
    for chunk in r:
        if not chunk.choices:
            continue
        finish = chunk.choices[0].finish_reason or finish
        for d in chunk.choices[0].delta.tool_calls or []:
            if d.index not in calls:  # the header: id and name first, with empty arguments
                assert d.id and d.function.name and d.function.arguments == "", d
                calls[d.index] = [d.id, d.function.name, ""]
            else:
                assert d.id is None and d.function.name is None
                calls[d.index][2] += d.function.arguments
    return [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_tool_calls_parse_and_validate(server, stream, choice):
    client, _, _ = server
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "get_time"}}
    for temperature in (0, 1.5):
        calls, finish = tool_calls_of(client, stream, tool_choice=tool_choice, parallel_tool_calls=False,
                                      temperature=temperature, seed=5)
        assert finish == "tool_calls" and len(calls) == 1, calls
        call_id, name, arguments = calls[0]
        assert call_id.startswith("call_") and name in TOOL_SCHEMAS
        if choice == "named":
            assert name == "get_time"
        jsonschema.validate(json.loads(arguments), TOOL_SCHEMAS[name])


def test_bad_constraints_are_400s_naming_them(server):
    client, _, _ = server
    bad = [
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}),
         "response_format"),
        (dict(guided_regex="[a-z"), "guided_regex"),
        (dict(guided_grammar='rot ::= "a"'), "guided_grammar"),
        (dict(guided_regex="a", guided_choice=["a"]), "guided_regex"),  # two constraints
        (dict(tools=[WEATHER], tool_choice="auto"), "tool_choice"),  # SmolLM2's template has no tools
        (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "response_format"),
    ]
    for kwargs, param in bad:
        with pytest.raises(openai.BadRequestError) as e:
            chat(client, "hi", False, **kwargs)
        assert e.value.status_code == 400 and e.value.body["param"] == param, (kwargs, e.value.body)
    with pytest.raises(openai.BadRequestError, match="guided_choice, guided_regex|guided_regex, guided_choice"):
        chat(client, "hi", False, guided_regex="a", guided_choice=["a"])


def test_grpc_structured_output(server):
    _, _, gport = server
    with grpc.insecure_channel(f"127.0.0.1:{gport}") as channel:
        stub = pdserve_pb2_grpc.GenerationStub(channel)
        meta = (("application", "pdserve-grpc"),)
        req = pdserve_pb2.GenerateRequest(
            messages=[pdserve_pb2.ChatMessage(role="user", content="Invent a person.")], max_tokens=60,
            temperature=1.5, seed=6, structured_output=pdserve_pb2.StructuredOutput(kind="json_schema",
                                                                                    value=json.dumps(PERSON)))
        chunks = list(stub.Generate(req, metadata=meta, timeout=180))
        assert chunks[-1].finish_reason == "stop"
        jsonschema.validate(json.loads("".join(c.text for c in chunks)), PERSON)
        req = pdserve_pb2.GenerateRequest(prompt="x", structured_output=pdserve_pb2.StructuredOutput(
            kind="regex", value="[a-"))
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(req, metadata=meta, timeout=60))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "structured_output" in e.value.details()


def _completion_answers(client: OpenAI) -> list[tuple[str, str | None]]:
    """(text, finish_reason) of each choice: /v1/completions, n=4, a schema through vLLM's guided_json."""
    r = client.completions.create(model=MODEL, prompt="A person with a pet, as JSON:", n=4, temperature=1.0, seed=7,
                                  max_tokens=80, extra_body={"guided_json": PERSON})
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    return [(c.text, c.finish_reason) for c in r.choices]


def _streamed_json_answers(client: OpenAI) -> list[tuple[str, str | None]]:
    """Chat json_object, n=3, streamed: each choice's text rebuilt from its deltas."""
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Describe a cat in JSON."}],
                                       n=3, temperature=1.0, seed=8, max_tokens=200, stream=True,
                                       response_format={"type": "json_object"})
    texts, finish = ["", "", ""], [None, None, None]
    for chunk in r:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            finish[c.index] = c.finish_reason or finish[c.index]
    return list(zip(texts, finish))


def _tool_answers(client: OpenAI, stream: bool, parallel: bool) -> list[tuple[list[tuple[str, str]], str | None]]:
    """Chat tool_choice "required", n=2: per choice its [(name, arguments)] and finish_reason."""
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Paris and the time in UTC?"}], n=2,
        temperature=1.0, seed=9, max_tokens=160, tools=[WEATHER, TIME], tool_choice="required",
        parallel_tool_calls=parallel, stream=stream)
    if not stream:
        return [([(t.function.name, t.function.arguments) for t in c.message.tool_calls or []], c.finish_reason)
                for c in sorted(r.choices, key=lambda c: c.index)]
    calls: list[dict[int, list[str]]] = [{}, {}]
    finish: list[str | None] = [None, None]
    for chunk in r:
        for c in chunk.choices:
            finish[c.index] = c.finish_reason or finish[c.index]
            for d in c.delta.tool_calls or []:
                if d.id is not None:
                    calls[c.index][d.index] = [d.function.name, ""]
                else:
                    calls[c.index][d.index][1] += d.function.arguments
    return [([tuple(per[i]) for i in sorted(per)], f) for per, f in zip(calls, finish)]


def _check_tool_answer(calls: list[tuple[str, str]], finish: str | None) -> bool:
    """Whether the answer ended ("tool_calls"); its calls validate, all of them or, cut by max_tokens, all
    but the last (the reader starts a call only after the one before it closed)."""
    assert finish in ("tool_calls", "length"), finish
    ended = finish == "tool_calls"
    assert calls or not ended, calls
    for name, arguments in calls if ended else calls[:-1]:
        jsonschema.validate(json.loads(arguments), TOOL_SCHEMAS[name])
    return ended


def test_concurrent_sampled_answers_validate(server):
    """Constrained and tool-call requests side by side (one engine batch, several grammars), sampled, n > 1:
    every answer that ends with "stop" / "tool_calls" validates and at least 3 in 4 end so. Parallel tool
    calls are checked apart: SmolLM2 tends to go on adding calls until max_tokens."""
    client, _, _ = server
    with ThreadPoolExecutor(5) as pool:
        jobs = [pool.submit(_completion_answers, client), pool.submit(_streamed_json_answers, client),
                pool.submit(_tool_answers, client, False, False), pool.submit(_tool_answers, client, True, False),
                pool.submit(_tool_answers, client, True, True)]
        person, objects, tools, streamed_tools, parallel = (j.result(timeout=240) for j in jobs)
    finished = 0
    for text, finish in person:
        assert finish in ("stop", "length"), finish
        if finish == "stop":
            jsonschema.validate(json.loads(text), PERSON)
            finished += 1
    for text, finish in objects:
        assert finish in ("stop", "length"), finish
        if finish == "stop":
            assert isinstance(json.loads(text), (dict, list)), text
            finished += 1
    for calls, finish in tools + streamed_tools:
        finished += _check_tool_answer(calls, finish)
        assert len(calls) <= 1, calls  # parallel_tool_calls false
    for calls, finish in parallel:
        _check_tool_answer(calls, finish)
    total = len(person) + len(objects) + len(tools) + len(streamed_tools)
    assert finished >= 0.75 * total, (finished, total, person, objects, tools, streamed_tools)
