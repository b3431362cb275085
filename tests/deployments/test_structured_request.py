"""The doors' structured-output and tool-call mapping (structured_request.py, tool_calls.py), without a server:
request fields → StructuredSpec, the checks that make a bad spec a 400 naming its field, the tool-call
schemas (checked with jsonschema) and the incremental tool-call reader."""

from __future__ import annotations

import copy
import json

import jsonschema
import pytest

from deployments.frontend.openai_protocol import ChatCompletionRequest, CompletionRequest
from deployments.frontend.prepare import ServedModel, prepare
from deployments.frontend.structured_request import one_constraint, spec_from_grpc, specs_from_fields
from deployments.frontend.tool_calls import (
    ToolCallParser, ToolOutput, finish_reason, plan_tools, template_supports_tools)
from engine import InvalidRequestError
from engine.model_loader import load_tokenizer
from engine.structured import StructuredSpec

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}, "required": ["b"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "days": {"type": "integer"}},
                                                "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
USER = [{"role": "user", "content": "hi"}]


def spec_of(**fields) -> StructuredSpec | None:
    found = one_constraint(specs_from_fields(fields))
    return None if found is None else found.spec


def field_of_error(fn, *args, **kwargs) -> str:
    with pytest.raises(InvalidRequestError) as e:
        fn(*args, **kwargs)
    return e.value.field


# ---------------------------------------------------------------------- fields → spec
def test_response_format_maps_to_specs_and_keeps_property_order():
    assert spec_of(response_format={"type": "text"}) is None
    assert spec_of(response_format={"type": "json_object"}) == StructuredSpec("json_object", "")
    spec = spec_of(response_format={"type": "json_schema", "json_schema": {"name": "n-1", "schema": SCHEMA,
                                                                           "strict": True}})
    assert spec.kind == "json_schema" and list(json.loads(spec.value)["properties"]) == ["b", "a"]


def test_vllm_extensions_map_to_specs():
    assert spec_of(guided_json=SCHEMA) == spec_of(guided_json=json.dumps(SCHEMA))
    assert spec_of(guided_regex=r"[a-z]{3}\d") == StructuredSpec("regex", r"[a-z]{3}\d")
    assert json.loads(spec_of(guided_choice=["yes", "no"]).value) == ["yes", "no"]
    assert spec_of(guided_grammar='root ::= "a" | "b"') == StructuredSpec("grammar", 'root ::= "a" | "b"')
    assert spec_of(structured_outputs={"regex": "x+"}) == StructuredSpec("regex", "x+")
    assert spec_of(structured_outputs={"json": SCHEMA}).kind == "json_schema"
    assert spec_of(structured_outputs={"json_object": True}) == StructuredSpec("json_object", "")
    assert spec_of(guided_regex=None, response_format=None) is None


@pytest.mark.parametrize("fields, field", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}),
     "response_format"),
    (dict(response_format={"type": "xml"}), "response_format"),
    (dict(response_format={"type": "json_schema"}), "response_format"),
    (dict(response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}}), "response_format"),
    (dict(response_format={"type": "json_object", "extra": 1}), "response_format"),
    (dict(guided_json="{not json"), "guided_json"),
    (dict(guided_json=[1]), "guided_json"),
    (dict(guided_regex="[a-z"), "guided_regex"),
    (dict(guided_regex=""), "guided_regex"),
    (dict(guided_choice=[]), "guided_choice"),
    (dict(guided_choice=["a", ""]), "guided_choice"),
    (dict(guided_grammar='rot ::= "a"'), "guided_grammar"),
    (dict(guided_grammar="root ::= "), "guided_grammar"),
    (dict(structured_outputs={"regex": "a", "choice": ["b"]}), "structured_outputs"),
    (dict(structured_outputs={"structural_tag": "x"}), "structured_outputs"),
    (dict(guided_regex="\ud800"), "guided_regex"),
])
def test_bad_constraints_name_their_field(fields, field):
    assert field_of_error(lambda: spec_of(**fields)) == field


def test_two_constraints_are_refused_naming_both():
    with pytest.raises(InvalidRequestError, match="guided_regex, guided_choice"):
        spec_of(guided_regex="a", guided_choice=["b"])
    with pytest.raises(InvalidRequestError, match="response_format, guided_json"):
        spec_of(response_format={"type": "json_object"}, guided_json=SCHEMA)
    assert spec_of(response_format={"type": "text"}, guided_regex="a").kind == "regex"  # text is no constraint


def test_grpc_spec_checked_and_named():
    assert spec_from_grpc("regex", "a+") == StructuredSpec("regex", "a+")
    assert field_of_error(spec_from_grpc, "xml", "") == "structured_output"
    assert field_of_error(spec_from_grpc, "json_schema", '{"type": 5}') == "structured_output"
    assert field_of_error(spec_from_grpc, "json_object", "x") == "structured_output"


# ---------------------------------------------------------------------- tools → plan
def test_required_schema_accepts_calls_of_each_tool_only():
    plan = plan_tools([WEATHER, TIME], "required", None)
    schema = json.loads(plan.spec.value)
    jsonschema.validate([{"name": "get_weather", "arguments": {"city": "Paris"}}], schema)
    jsonschema.validate([{"name": "get_time", "arguments": {}},
                         {"name": "get_weather", "arguments": {"city": "x", "days": 2}}], schema)
    for bad in ([], [{"name": "nope", "arguments": {}}], [{"name": "get_weather", "arguments": {"days": 1}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    one = json.loads(plan_tools([WEATHER], "required", False).spec.value)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "arguments": {"city": "a"}}] * 2, one)
    assert plan.output == ToolOutput(None) and plan.template_tools == [WEATHER, TIME]


def test_named_function_is_constrained_to_its_parameters():
    plan = plan_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}}, None)
    assert json.loads(plan.spec.value) == WEATHER["function"]["parameters"] and plan.output == ToolOutput("get_weather")
    assert json.loads(plan_tools([TIME], {"type": "function", "function": {"name": "get_time"}}, None).spec.value) \
        == {"type": "object", "properties": {}}


def test_none_and_no_tools_mean_text():
    for tools, choice in (([WEATHER], "none"), (None, None), ([], None), (None, "auto"), (None, "none")):
        plan = plan_tools(tools, choice, None)
        assert plan.spec is None and plan.output is None and plan.template_tools is None


@pytest.mark.parametrize("tools, choice, field", [
    ([WEATHER], None, "tool_choice"),  # "auto" by default: no parser for free-form tool calls
    ([WEATHER], "auto", "tool_choice"),
    (None, "required", "tool_choice"),
    ([WEATHER], {"type": "function", "function": {"name": "other"}}, "tool_choice"),
    ([WEATHER], "sometimes", "tool_choice"),
    ([{"type": "function"}], "required", "tools"),
    ([{"type": "code", "function": {"name": "f"}}], "required", "tools"),
    ([{"type": "function", "function": {"name": "has space"}}], "required", "tools"),
    ([WEATHER, WEATHER], "required", "tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}], "required", "tools"),
])
def test_bad_tool_requests_name_their_field(tools, choice, field):
    assert field_of_error(plan_tools, tools, choice, None) == field


def test_tool_choice_and_another_constraint_are_refused():
    req = ChatCompletionRequest(messages=USER, tools=[WEATHER], tool_choice="required", guided_regex="a")
    with pytest.raises(InvalidRequestError, match="guided_regex, tool_choice"):
        req.sampling_input()
    assert CompletionRequest(prompt="x", guided_choice=["a", "b"]).sampling_input().structured.kind == "choice"


# ---------------------------------------------------------------------- text → calls
def parse(output: ToolOutput, text: str, chunk: int) -> tuple[ToolCallParser, list]:
    parser = ToolCallParser(output)
    deltas = []
    for i in range(0, len(text), chunk):
        deltas += parser.feed(text[i:i + chunk])
    return parser, deltas


@pytest.mark.parametrize("chunk", [1, 2, 7, 10_000])
def test_streamed_deltas_rebuild_the_calls(chunk):
    text = '[ {"name": "get_weather", "arguments": {"city": "Pa\\"ris}", "days": [1, {"x": 2}]}},\n' \
           '{"name":"get_time","arguments":7} ]  '
    parser, deltas = parse(ToolOutput(None), text, chunk)
    assert parser.complete
    calls = [(c.name, json.loads(c.arguments)) for c in parser.calls]
    assert calls == [("get_weather", {"city": 'Pa"ris}', "days": [1, {"x": 2}]}), ("get_time", 7)]
    headers = [d for d in deltas if d.id is not None]
    assert [(h.index, h.name, h.arguments) for h in headers] == [(0, "get_weather", ""), (1, "get_time", "")]
    for k, call in enumerate(parser.calls):
        mine = [d for d in deltas if d.index == k]
        assert mine[0].id == call.id and call.id.startswith("call_")  # the header comes first
        assert "".join(d.arguments for d in mine) == call.arguments
    assert finish_reason(parser, "stop") == "tool_calls"


def test_named_output_is_the_arguments():
    parser, deltas = parse(ToolOutput("get_weather"), ' {"city": "Oslo"}\n', 3)
    assert parser.complete and parser.calls[0].name == "get_weather"
    assert json.loads(parser.calls[0].arguments) == {"city": "Oslo"}
    assert deltas[0].name == "get_weather" and "".join(d.arguments for d in deltas) == parser.calls[0].arguments


def test_cut_output_is_not_a_finished_call():
    parser, _ = parse(ToolOutput(None), '[{"name": "get_weather", "arguments": {"ci', 4)
    assert not parser.complete and parser.calls[0].arguments == '{"ci'
    assert finish_reason(parser, "length") == "length"


# ---------------------------------------------------------------------- the chat template
@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


TOOL_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.function.name }}"
    "{{ c.function.arguments | tojson }}{% endfor %}{% else %}{{ m.content }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_smollm2_template_has_no_tools(tokenizer):
    model = ServedModel.of("m", tokenizer, 2048)
    assert not template_supports_tools(tokenizer)
    req = ChatCompletionRequest(messages=USER, tools=[WEATHER], tool_choice="required")
    prepared = prepare(model, req.prompt_input(), req.sampling_input())
    assert prepared.params.structured.kind == "json_schema"
    plain = tokenizer.apply_chat_template(USER, add_generation_prompt=True, tokenize=True)
    assert prepared.prompt_token_ids == list(plain if isinstance(plain, list) else plain["input_ids"])
    history = USER + [{"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}, {"role": "tool", "tool_call_id": "c1",
                                                                     "content": "sunny"}]
    req = ChatCompletionRequest(messages=history)
    with pytest.raises(InvalidRequestError, match=r"messages\[1\]: this model's chat template"):
        prepare(model, req.prompt_input(), req.sampling_input())


def test_a_template_with_tools_renders_them_and_the_history(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = TOOL_TEMPLATE
    assert template_supports_tools(tok)
    history = USER + [{"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                                            "function": {"name": "get_weather",
                                                                                         "arguments": '{"city": "Oslo"}'}}]},
                      {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    req = ChatCompletionRequest(messages=history, tools=[WEATHER, TIME], tool_choice="required")
    prepared = prepare(ServedModel.of("m", tok, 2048), req.prompt_input(), req.sampling_input())
    text = tok.decode(prepared.prompt_token_ids)
    assert text.startswith("TOOLS:get_weather;get_time;") and 'CALL get_weather{"city": "Oslo"}' in text
    assert "<tool>sunny" in text


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


@pytest.mark.parametrize("fields,field,words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "string", "maxLength": 1e12}}}}, "response_format", "maxLength"),
    ({"guided_json": _nested(250)}, "guided_json", "deeper"),
    ({"guided_json": '{"properties": {"x": ' * 5000 + "{}" + "}}" * 5000}, "guided_json", "deeper"),  # too deep for json.loads itself
    ({"structured_outputs": {"json": {"type": "object", "properties": {f"p{i}": {"type": "integer"}
                                                                      for i in range(600)}}}},
     "structured_outputs", "properties"),
    ({"guided_choice": [f"c{i}" for i in range(2000)]}, "guided_choice", "choices"),
])
def test_schema_limits_are_a_400_naming_the_field_before_any_compile(fields, field, words):
    """Past a limit: an InvalidRequestError (HTTP 400) naming the field, never a RecursionError, never
    xgrammar's own text; checked before xgrammar parses anything (`_compile_error` is not reached)."""
    from deployments.frontend import structured_request

    calls = []
    real = structured_request._compile_error
    structured_request._compile_error = lambda kind, value: calls.append(kind) or real(kind, value)
    try:
        with pytest.raises(InvalidRequestError) as exc:
            specs_from_fields(fields)
    finally:
        structured_request._compile_error = real
    assert exc.value.field == field and words in exc.value.message and ".cc" not in exc.value.message
    assert calls == []
