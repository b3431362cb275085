"""Structured-output request fields → `StructuredSpec` (engine/structured.py), for both doors.

    field as the client sends it                                  StructuredSpec(kind, value)
    response_format {"type": "text"}                              None (free text)
    response_format {"type": "json_object"}                       ("json_object", "")
    response_format {"type": "json_schema", "json_schema": {...}} ("json_schema", the schema as JSON)
    guided_json (a schema, or its JSON text)                      ("json_schema", ...)   vLLM's names
    guided_regex / guided_choice / guided_grammar                 ("regex" | "choice" | "grammar", ...)
    structured_outputs {json | regex | choice | grammar | json_object}   the same (vLLM's newer object)
    gRPC `structured_output {kind, value}`                        (kind, value) as sent
    tools + tool_choice "required" / a named function             tool_calls.py builds a json_schema

At most one constraint per request: two are a 400 naming both. Every spec is first held to this
door's `SchemaLimits` (depth, properties, length bounds, choices: `set_schema_limits`, from the engine
settings `max_schema_*`), then parsed here with xgrammar (no tokenizer needed, so the door of a
disaggregated deployment, which has no engine, can do it); a spec past a limit or that does not parse
is an `InvalidRequestError` naming the field the client used, before anything is queued. The engine
compiles it against the tokenizer later, off its step loop, under a time budget (engine/structured.py).
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any, NamedTuple

from engine import InvalidRequestError
from engine.structured import SchemaLimits, StructuredSpec, check_choice_limits, check_schema_limits, compile_error_text

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
# vLLM's request fields (and the keys of its `structured_outputs` object) → the spec kind.
GUIDED_FIELDS = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
STRUCTURED_OUTPUTS_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                           "json_object": "json_object"}
# OpenAI's rule for a json_schema's `name` (and a function's).
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_ERROR_CHARS = 300


class FieldSpec(NamedTuple):
    """A spec and the request field it came from (what errors about it name)."""

    spec: StructuredSpec
    field: str


# ---------------------------------------------------------------------- compile check
_limits = SchemaLimits()


def set_schema_limits(limits: SchemaLimits) -> None:
    """This door's limits (one per process: the server sets them from its engine settings at start)."""
    global _limits
    _limits = limits


def schema_limits() -> SchemaLimits:
    return _limits


@functools.lru_cache(maxsize=128)
def _compile_error(kind: str, value: str) -> str | None:
    """Why xgrammar cannot build a grammar for (kind, value); None if it can."""
    import xgrammar  # NOTE: imported on first use: a door that never sees a constraint never loads it

    try:
        if kind == "json_schema":
            xgrammar.Grammar.from_json_schema(value)
        elif kind == "regex":
            xgrammar.Grammar.from_regex(value)
        elif kind == "grammar":
            xgrammar.Grammar.from_ebnf(value)
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError with its parser's message
        return compile_error_text(e)[:MAX_ERROR_CHARS]
    return None


def make_spec(kind: str, value: str, field: str) -> StructuredSpec:
    """`StructuredSpec(kind, value)`, checked (`check_spec`); errors name `field`."""
    if kind not in KINDS:
        raise InvalidRequestError(field, f"unknown kind {str(kind)[:32]!r}; one of {', '.join(KINDS)}")
    try:
        spec = StructuredSpec(kind, value)
    except InvalidRequestError as e:  # the engine names its own field; the client used `field`
        raise InvalidRequestError(field, e.message) from None
    return check_spec(spec, field)


def check_spec(spec: StructuredSpec, field: str) -> StructuredSpec:
    """`spec` if it compiles; else `InvalidRequestError(field, why)`."""
    if not spec.value.isascii():
        try:
            spec.value.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequestError(field, "must be valid Unicode text (it holds a lone surrogate)") from None
    if spec.kind == "json_object":
        if spec.value:
            raise InvalidRequestError(field, "json_object takes no value")
    elif spec.kind == "choice":
        check_choice_limits(len(_check_choices(_parsed(spec.value, field), field)), field, _limits)
    elif spec.kind == "json_schema":
        schema = _parsed(spec.value, field)
        if not isinstance(schema, dict):
            raise InvalidRequestError(field, "the schema must be a JSON object")
        check_schema_limits(schema, field, _limits)  # NOTE: before xgrammar parses it (cubic in the depth)
    elif not spec.value:
        raise InvalidRequestError(field, f"the {spec.kind} must not be empty")
    error = _compile_error(spec.kind, spec.value)
    if error is not None:
        raise InvalidRequestError(field, f"does not compile: {error}")
    return spec


def _parsed(text: str, field: str) -> Any:
    """`text` as JSON; None if it is not JSON. A 400 if it nests too deeply to parse."""
    try:
        return json.loads(text)
    except RecursionError:
        raise InvalidRequestError(field, f"nests deeper than {_limits.max_depth} levels") from None
    except ValueError:
        return None


def _check_choices(choices: Any, field: str) -> list[str]:
    if not isinstance(choices, list) or not choices or \
            not all(isinstance(c, str) and c for c in choices):
        raise InvalidRequestError(field, "must be a non-empty list of non-empty strings")
    return choices


# ---------------------------------------------------------------------- HTTP fields
def schema_spec(schema: Any, field: str) -> StructuredSpec:
    """A json_schema spec from a schema object or its JSON text; checked."""
    if isinstance(schema, str):
        schema = _parsed(schema, field)
        if schema is None:
            raise InvalidRequestError(field, "the schema is not valid JSON")
    if not isinstance(schema, dict):
        raise InvalidRequestError(field, "the schema must be a JSON object")
    check_schema_limits(schema, field, _limits)  # before json.dumps, which recurses
    # NOTE: keys keep their order: properties are generated in the schema's order.
    return make_spec("json_schema", json.dumps(schema), field)


def _value_spec(kind: str, value: Any, field: str) -> StructuredSpec:
    """One vLLM-style constraint (guided_* or a structured_outputs key) as a checked spec."""
    if kind == "json_schema":
        return schema_spec(value, field)
    if kind == "json_object":
        if value is not True:
            raise InvalidRequestError(field, "json_object must be true")
        return StructuredSpec("json_object", "")
    if kind == "choice":
        return make_spec("choice", json.dumps(_check_choices(value, field)), field)
    if not isinstance(value, str):
        raise InvalidRequestError(field, f"the {kind} must be a string")
    return make_spec(kind, value, field)


def _response_format_spec(fmt: Any) -> StructuredSpec | None:
    field = "response_format"
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in ("text", "json_object", "json_schema"):
        raise InvalidRequestError(field, 'type must be "text", "json_object" or "json_schema"')
    extra = sorted(set(fmt) - ({"type", "json_schema"} if kind == "json_schema" else {"type"}))
    if extra:
        raise InvalidRequestError(field, f"unknown key {extra[0][:64]!r} for type {kind!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredSpec("json_object", "")
    body = fmt.get("json_schema")
    if not isinstance(body, dict):
        raise InvalidRequestError(field, 'type "json_schema" needs a `json_schema` object')
    extra = sorted(set(body) - {"name", "description", "schema", "strict"})
    if extra:
        raise InvalidRequestError(field, f"json_schema: unknown key {extra[0][:64]!r}")
    name = body.get("name")
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise InvalidRequestError(field, "json_schema.name: 1 to 64 letters, digits, underscores or dashes")
    if not isinstance(body.get("description", ""), str) or body.get("strict") not in (None, True, False):
        raise InvalidRequestError(field, "json_schema: description must be a string and strict a boolean")
    if "schema" not in body:
        raise InvalidRequestError(field, "json_schema.schema: required")
    # `strict` either way: the output always follows the schema exactly (it is enforced token by token).
    return schema_spec(body["schema"], field)


def _structured_outputs_spec(obj: Any) -> StructuredSpec:
    field = "structured_outputs"
    if not isinstance(obj, dict):
        raise InvalidRequestError(field, f"must be an object with one of {', '.join(STRUCTURED_OUTPUTS_KEYS)}")
    unknown = sorted(k for k, v in obj.items() if k not in STRUCTURED_OUTPUTS_KEYS and v is not None)
    if unknown:
        raise InvalidRequestError(field, f"{unknown[0][:64]!r} is not supported; one of "
                                         f"{', '.join(STRUCTURED_OUTPUTS_KEYS)}")
    given = [k for k in STRUCTURED_OUTPUTS_KEYS if obj.get(k) is not None]
    if len(given) != 1:
        raise InvalidRequestError(field, f"set exactly one of {', '.join(STRUCTURED_OUTPUTS_KEYS)} "
                                         f"(got {' and '.join(given) or 'none'})")
    return _value_spec(STRUCTURED_OUTPUTS_KEYS[given[0]], obj[given[0]], field)


def specs_from_fields(fields: dict[str, Any]) -> list[FieldSpec]:
    """Every constraint among the sent HTTP fields (name → value; None or absent: not sent), each
    checked; `response_format` "text" is none. Use `one_constraint` on the result."""
    found: list[FieldSpec] = []
    for name, value in fields.items():
        if value is None:
            continue
        if name == "response_format":
            spec = _response_format_spec(value)
        elif name == "structured_outputs":
            spec = _structured_outputs_spec(value)
        elif name in GUIDED_FIELDS:
            spec = _value_spec(GUIDED_FIELDS[name], value, name)
        else:
            raise AssertionError(f"not a structured-output field: {name}")
        if spec is not None:
            found.append(FieldSpec(spec, name))
    return found


def one_constraint(found: list[FieldSpec]) -> FieldSpec | None:
    """The one constraint, None for none; `InvalidRequestError` naming them all for more than one."""
    if len(found) > 1:
        names = [f.field for f in found]
        raise InvalidRequestError(names[0], f"one output constraint per request, got {len(names)}: "
                                            f"{', '.join(names)}; send one of them")
    return found[0] if found else None


# ---------------------------------------------------------------------- gRPC
def spec_from_grpc(kind: str, value: str, field: str = "structured_output") -> StructuredSpec:
    """The proto's `structured_output {kind, value}` as a checked spec."""
    return make_spec(kind, value, field)
