"""Tool calls through structured outputs: the request's tools → a JSON schema, the constrained text → calls.

    tool_choice                  constraint (a json_schema spec)               the model writes
    "required"                   an array of {"name": const, "arguments": <its   [{"name": "f", "arguments": {...}}]
                                 parameters>}, anyOf over the tools (one item
                                 when parallel_tool_calls is false)
    {"type": "function", ...}    that function's parameters                     {...} (the arguments)
    "none"                       none: free text, the template gets no tools
    "auto"                       refused: it needs a parser for the model's own tool-call syntax (400)

`ToolCallParser` reads the text incrementally, so the streamed `delta.tool_calls` (index, id, type and
name first, then argument fragments) and the non-streamed `message.tool_calls` come from the same scan:
the fragments of a call concatenate to its `arguments` string (the model's JSON text as written).
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from dataclasses import dataclass
from typing import Any, NamedTuple

from deployments.frontend.prompt_input import PromptInput
from deployments.frontend.structured_request import NAME_PATTERN, schema_spec
from engine import InvalidRequestError
from engine.structured import StructuredSpec

TOOL_KEYS = {"type", "function"}
FUNCTION_KEYS = {"name", "description", "parameters", "strict"}
MAX_TOOLS = 128  # OpenAI's limit
EMPTY_PARAMETERS = {"type": "object", "properties": {}}  # a function without `parameters` takes none


class ToolOutput(NamedTuple):
    """How the answer's text is read as tool calls."""

    function_name: str | None  # a named tool_choice: the text is its arguments; None: the "required" array


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What one chat request's tools mean for its prompt, its constraint and its answer."""

    choice: str  # "none" | "auto" | "required" | "function"
    spec: StructuredSpec | None = None  # the output constraint (required / named)
    output: ToolOutput | None = None  # None: the answer is text
    template_tools: list[dict] | None = None  # what the chat template gets (None: no tools)


NO_TOOLS = ToolPlan("none")


# ---------------------------------------------------------------------- request → plan
def _functions(tools: Any) -> dict[str, dict]:
    """name → the function object of each tool; `InvalidRequestError("tools")` for a malformed one."""
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise InvalidRequestError("tools", f"must be a list of at most {MAX_TOOLS} tools")
    out: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or set(tool) - TOOL_KEYS:
            raise InvalidRequestError("tools", f'{where}: must be {{"type": "function", "function": {{...}}}}')
        fn = tool.get("function")
        if not isinstance(fn, dict) or set(fn) - FUNCTION_KEYS:
            raise InvalidRequestError("tools", f"{where}.function: an object with keys among "
                                               f"{', '.join(sorted(FUNCTION_KEYS))}")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            raise InvalidRequestError("tools", f"{where}.function.name: 1 to 64 letters, digits, underscores "
                                               "or dashes")
        if name in out:
            raise InvalidRequestError("tools", f"{where}.function.name: {name!r} is defined twice")
        if not isinstance(fn.get("description", ""), str) or fn.get("strict") not in (None, True, False):
            raise InvalidRequestError("tools", f"{where}.function: description must be a string, strict a boolean")
        if not isinstance(fn.get("parameters", {}), dict):
            raise InvalidRequestError("tools", f"{where}.function.parameters: must be a JSON schema object")
        out[name] = fn
    return out


def _parameters(fn: dict) -> dict:
    return fn.get("parameters") or EMPTY_PARAMETERS


def _required_schema(functions: dict[str, dict], parallel: bool) -> dict:
    calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": _parameters(fn)},
              "required": ["name", "arguments"]} for name, fn in functions.items()]
    schema: dict[str, Any] = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
                              "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def plan_tools(tools: Any, tool_choice: Any, parallel_tool_calls: bool | None) -> ToolPlan:
    """The plan for a chat request's `tools`, `tool_choice` and `parallel_tool_calls` (None: not sent).

    Raises `InvalidRequestError` naming the field: malformed tools, a choice naming no tool, "auto"
    with tools, "required" or a function without tools, a parameters schema that does not compile."""
    functions = _functions(tools) if tools is not None else {}
    choice = tool_choice if tool_choice is not None else ("auto" if functions else "none")
    if choice == "none":
        return NO_TOOLS
    if choice == "auto":
        if functions:
            raise InvalidRequestError("tool_choice", '"auto" is not supported: this server has no parser for a '
                                                     "model's own tool-call syntax (and SmolLM2's chat template "
                                                     'has no tools at all); send "required" or '
                                                     '{"type": "function", "function": {"name": ...}}')
        return NO_TOOLS
    if not functions:
        raise InvalidRequestError("tool_choice", "needs `tools`")
    if choice == "required":
        spec = schema_spec(_required_schema(functions, parallel_tool_calls is not False), "tools")
        return ToolPlan("required", spec, ToolOutput(None), list(tools))
    name = _named_function(tool_choice)
    if name not in functions:
        raise InvalidRequestError("tool_choice", f"names function {name[:64]!r}, which is not among the tools")
    spec = schema_spec(_parameters(functions[name]), "tools")
    return ToolPlan("function", spec, ToolOutput(name), list(tools))


def _named_function(tool_choice: Any) -> str:
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or set(tool_choice) != TOOL_KEYS \
            or not isinstance(fn, dict) or set(fn) != {"name"} or not isinstance(fn["name"], str):
        raise InvalidRequestError("tool_choice", 'must be "none", "auto", "required" or '
                                                 '{"type": "function", "function": {"name": ...}}')
    return fn["name"]


# ---------------------------------------------------------------------- the chat template
_SUPPORTS_TOOLS: dict[int, tuple[Any, bool]] = {}  # id(tokenizer) → (tokenizer, answer); a handful of entries
_PROBE = [{"role": "user", "content": "x"}]
_PROBE_TOOLS = [{"type": "function", "function": {"name": "probe", "description": "d", "parameters": EMPTY_PARAMETERS}}]


def template_supports_tools(tokenizer: Any) -> bool:
    """Whether the chat template renders tools: the probe prompt changes when tools are passed."""
    hit = _SUPPORTS_TOOLS.get(id(tokenizer))
    if hit is not None and hit[0] is tokenizer:
        return hit[1]
    try:
        plain = tokenizer.apply_chat_template(_PROBE, add_generation_prompt=True, tokenize=False)
        with_tools = tokenizer.apply_chat_template(_PROBE, tools=_PROBE_TOOLS, add_generation_prompt=True,
                                                   tokenize=False)
        answer = plain != with_tools
    except Exception:  # noqa: BLE001 - no template, or one that fails on tools: it does not support them
        answer = False
    if len(_SUPPORTS_TOOLS) > 8:
        _SUPPORTS_TOOLS.clear()
    _SUPPORTS_TOOLS[id(tokenizer)] = (tokenizer, answer)
    return answer


def history_tool_fields(index: int, role: str, tool_calls: Any, tool_call_id: Any) -> dict[str, Any]:
    """The tool fields of one history message as chat templates take them (arguments as objects)."""
    out: dict[str, Any] = {}
    if tool_calls:
        if role != "assistant" or not isinstance(tool_calls, list):
            raise InvalidRequestError("messages", f"messages[{index}].tool_calls: a list, on assistant messages")
        calls = []
        for call in tool_calls:
            fn = call.get("function") if isinstance(call, dict) else None
            try:
                arguments = json.loads(fn["arguments"]) if isinstance(fn["arguments"], str) else fn["arguments"]
                calls.append({"id": call.get("id"), "type": "function",
                              "function": {"name": str(fn["name"]), "arguments": arguments}})
            except (TypeError, KeyError, ValueError):
                raise InvalidRequestError("messages", f"messages[{index}].tool_calls: each is {{id, type, function: "
                                                      "{name, arguments (a JSON string)}}") from None
        out["tool_calls"] = calls
    if tool_call_id is not None:
        if role != "tool" or not isinstance(tool_call_id, str):
            raise InvalidRequestError("messages", f"messages[{index}].tool_call_id: a string, on tool messages")
        out["tool_call_id"] = tool_call_id
    return out


def check_chat_template(tokenizer: Any, prompt: PromptInput) -> PromptInput:
    """`prompt`, without tools if the template does not render them; `InvalidRequestError` for tool
    messages such a template cannot render."""
    tool_messages = [i for i, m in enumerate(prompt.value) if m.get("role") == "tool" or m.get("tool_calls")]
    if (tool_messages or prompt.tools) and not template_supports_tools(tokenizer):
        if tool_messages:
            raise InvalidRequestError("messages", f"messages[{tool_messages[0]}]: this model's chat template does "
                                                  "not render tool calls or tool results")
        # NOTE: "required" and named calls still work: the constraint, not the prompt, makes the call.
        return dataclasses.replace(prompt, tools=None)
    return prompt


# ---------------------------------------------------------------------- text → calls
class ToolCallDelta(NamedTuple):
    """One streamed piece of a call: the header (id and name, arguments "") once, then fragments."""

    index: int
    id: str | None
    name: str | None
    arguments: str


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str = ""


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class _Value:
    """Finds where one JSON value ends, a character at a time (the grammar made it well formed)."""

    depth: int = 0
    started: bool = False
    in_string: bool = False
    escaped: bool = False
    done: bool = False

    def take(self, ch: str) -> bool:
        """Whether `ch` belongs to the value; sets `done` once the value is complete."""
        if not self.started:
            if ch.isspace():
                return False
            self.started = True
        elif self.depth == 0 and not self.in_string and (ch in ",]}" or ch.isspace()):
            self.done = True  # a scalar ended; `ch` is not part of it
            return False
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
                self.done = self.depth == 0
        elif ch == '"':
            self.in_string = True
        elif ch in "[{":
            self.depth += 1
        elif ch in "]}":
            self.depth -= 1
            self.done = self.depth == 0
        return True


class ToolCallParser:
    """Reads the constrained text of a tool-call answer incrementally; see the module docstring."""

    def __init__(self, output: ToolOutput):
        self.calls: list[ToolCall] = []
        self._named = output.function_name is not None
        self._state = "value" if self._named else "start"
        self._key = "arguments"
        self._key_chars: list[str] = []
        self._name_chars: list[str] = []
        self._value = _Value()
        self._pending = ""  # arguments seen before the call's name (never, with the schemas built here)
        self._announced = False
        if self._named:
            self.calls.append(ToolCall(_call_id(), output.function_name))

    @property
    def complete(self) -> bool:
        """The whole answer was read (a cut one, finish_reason "length", is not)."""
        return self._state == "end"

    def feed(self, text: str) -> list[ToolCallDelta]:
        """The deltas `text` completes: a header when a call's name is known, then its argument fragments."""
        out: list[ToolCallDelta] = []
        i = 0
        while i < len(text):
            if self._step(text[i], out):
                i += 1
        return _merged(out)

    def _step(self, ch: str, out: list[ToolCallDelta]) -> bool:
        """Consume `ch` (True) or leave it to the next state (False: a scalar value ended at it)."""
        state = self._state
        if state == "value":
            return self._value_char(ch, out)
        if state == "key_str":
            if ch == '"':
                self._key, self._key_chars, self._state = "".join(self._key_chars), [], "colon"
            else:
                self._key_chars.append(ch)
        elif state == "start" and ch == "[":
            self._state = "array"
        elif state == "array" and ch == "{":
            self.calls.append(ToolCall(_call_id(), ""))
            self._announced, self._pending, self._state = False, "", "key"
        elif state == "array" and ch == "]":
            self._state = "end"
        elif state == "key" and ch == '"':
            self._state = "key_str"
        elif state == "key" and ch == "}":
            self._state = "array"
        elif state == "colon" and ch == ":":
            self._value, self._name_chars, self._state = _Value(), [], "value"
        return True  # whitespace, commas, and whatever the grammar allows after the end

    def _value_char(self, ch: str, out: list[ToolCallDelta]) -> bool:
        taken = self._value.take(ch)
        call, index = self.calls[-1], len(self.calls) - 1
        if taken and self._key == "name":
            self._name_chars.append(ch)
        elif taken and self._key == "arguments":
            if self._announced:
                call.arguments += ch
                out.append(ToolCallDelta(index, None, None, ch))
            else:
                self._pending += ch
        if self._named and not self._announced and self._value.started:
            self._announce(out)
        if self._value.done:
            if self._key == "name":
                call.name = str(json.loads("".join(self._name_chars)))
                self._announce(out)
            self._state = "end" if self._named else "key"
        return taken or not self._value.done

    def _announce(self, out: list[ToolCallDelta]) -> None:
        call, index = self.calls[-1], len(self.calls) - 1
        self._announced = True
        out.append(ToolCallDelta(index, call.id, call.name, ""))
        if self._pending:
            call.arguments += self._pending
            out.append(ToolCallDelta(index, None, None, self._pending))
            self._pending = ""


def _merged(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Consecutive fragments of one call as one delta (a header stays apart: OpenAI sends it alone)."""
    out: list[ToolCallDelta] = []
    for d in deltas:
        if out and d.id is None and out[-1].id is None and out[-1].index == d.index:
            out[-1] = out[-1]._replace(arguments=out[-1].arguments + d.arguments)
        else:
            out.append(d)
    return out


def finish_reason(parser: ToolCallParser, engine_reason: str | None) -> str | None:
    """OpenAI's "tool_calls" for an answer read whole; the engine's reason ("length", ...) otherwise."""
    return "tool_calls" if parser.complete and engine_reason == "stop" else engine_reason


class ToolCallReader:
    """The tool calls of every choice of one request (one parser per choice index)."""

    def __init__(self, output: ToolOutput):
        self.output = output
        self._parsers: dict[int, ToolCallParser] = {}

    def parser(self, index: int) -> ToolCallParser:
        if index not in self._parsers:
            self._parsers[index] = ToolCallParser(self.output)
        return self._parsers[index]

    def feed(self, index: int, text: str, engine_reason: str | None) -> tuple[list[ToolCallDelta], str | None]:
        """Choice `index`'s deltas for `text`, and its finish_reason (on its last chunk)."""
        parser = self.parser(index)
        deltas = parser.feed(text)
        return deltas, finish_reason(parser, engine_reason) if engine_reason else None
