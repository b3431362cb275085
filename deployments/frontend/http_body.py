"""A request body, from bytes to a pydantic request, where every hazard is a 4xx and none a 500.

    bytes (at most MAX_BODY_BYTES: 413) ─▶ UTF-8 ─▶ JSON (no NaN/Infinity, no 4301-digit ints,
    no nesting past Python's recursion limit) ─▶ an object ─▶ strings without lone surrogates
    ─▶ openai_fields.drop_off_fields ─▶ the pydantic model (strict types)

Whatever the Content-Type says (curl -d sends a form type), the body is read as JSON. Bodies over
INLINE_PARSE_BYTES are parsed on a worker thread, so the event loop keeps serving other streams.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from deployments.frontend.openai_fields import drop_off_fields
from deployments.frontend.openai_protocol import APIError

T = TypeVar("T", bound=BaseModel)

# The largest body taken: a full-context prompt as token ids is well under 1 MiB.
MAX_BODY_BYTES = 4 * 1024 * 1024
# Larger bodies are parsed on a worker thread: ~100 ms of parsing a few MiB would stall every stream
# this event loop serves (the thread yields the GIL to the loop every few ms).
INLINE_PARSE_BYTES = 64 * 1024
# The longest a body may take to arrive after its headers (the server's http_body_timeout_s).
BODY_TIMEOUT_S = 30.0
# Valid UTF-8 cannot hold a surrogate: only a JSON escape (\ud800-\udfff) can make one.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _too_large(limit: int) -> APIError:
    return APIError(413, f"request body larger than {limit} bytes", "invalid_request_error",
                    code="request_too_large")


async def read_body(request: Request, limit: int = MAX_BODY_BYTES, timeout_s: float | None = BODY_TIMEOUT_S) -> bytes:
    """The raw body; 413 as soon as the declared length or the bytes read pass `limit`; 408 when it has
    not arrived whole within `timeout_s` (a client that sends its headers and then trickles or stalls)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not (declared.isascii() and declared.isdigit()):
            raise APIError.bad_request("Content-Length: not a number", None, "invalid_value")
        if len(declared) > 18 or int(declared) > limit:  # NOTE: never int() a header of 10,000 digits
            raise _too_large(limit)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():  # NOTE: counted while read: Content-Length may be absent
                size += len(chunk)
                if size > limit:
                    raise _too_large(limit)
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout_s:g}s (http_body_timeout_s)",
                       "invalid_request_error", code="body_timeout", headers={"Connection": "close"}) from None
    return b"".join(chunks)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def loads_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object; APIError(400, code invalid_json) for anything else."""
    try:
        data = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except UnicodeDecodeError:
        raise APIError.bad_request("the body is not valid UTF-8", None, "invalid_json") from None
    except RecursionError:
        raise APIError.bad_request("the JSON body is nested too deeply", None, "invalid_json") from None
    except ValueError as e:  # JSONDecodeError, NaN/Infinity, an integer longer than Python parses
        raise APIError.bad_request(f"malformed JSON body: {str(e)[:200]}", None, "invalid_json") from None
    if not isinstance(data, dict):
        raise APIError.bad_request(f"the body must be a JSON object, not {type(data).__name__}", None, "invalid_json")
    bad = _field_with_lone_surrogate(data) if _SURROGATE_ESCAPE.search(raw) else None
    if bad is not None:
        raise APIError.bad_request(f"{bad}: text must be valid Unicode (it holds a lone surrogate)", bad,
                                   "invalid_value")
    return data


def _has_surrogate(s: str) -> bool:
    if s.isascii():
        return False
    try:
        s.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


def _field_with_lone_surrogate(data: dict[str, Any]) -> str | None:
    """The top-level field whose value (or name) holds a string JSON allows but Unicode does not."""
    for name, value in data.items():
        if _has_surrogate(name):
            return "body"
        todo = [value]
        while todo:  # NOTE: a loop, not recursion: depth is whatever the JSON parser allowed
            v = todo.pop()
            if isinstance(v, str):
                if _has_surrogate(v):
                    return name
            elif isinstance(v, list):
                todo.extend(v)
            elif isinstance(v, dict):
                todo.extend(v.keys())
                todo.extend(v.values())
    return None


def validation_error(errors: list[dict]) -> APIError:
    """One 400 for pydantic errors: `param` is the first offending top-level field."""
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    msg = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}"
                    for e in errors[:5])
    return APIError.bad_request(msg[:1000] or "invalid request body", loc[0][:64] if loc else None, "invalid_value")


async def parse_body(request: Request, model: type[T], limit: int = MAX_BODY_BYTES,
                     timeout_s: float | None = BODY_TIMEOUT_S) -> T:
    """The body as `model`; APIError (400, 408, 413) for every way it can be wrong."""
    raw = await read_body(request, limit, timeout_s)
    request.state.body_bytes = len(raw)  # the routes prepare a large body off the loop too (http_app.py)
    if len(raw) > INLINE_PARSE_BYTES:
        return await asyncio.to_thread(parse_bytes, raw, model)
    return parse_bytes(raw, model)


def parse_bytes(raw: bytes, model: type[T]) -> T:
    """`raw` as `model`; APIError(400) for every way it can be wrong."""
    data = drop_off_fields(loads_object(raw), model.model_fields)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e.errors(include_url=False)) from None
    except RecursionError:
        raise APIError.bad_request("the JSON body is nested too deeply", None, "invalid_json") from None
