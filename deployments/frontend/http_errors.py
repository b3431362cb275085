"""HTTP errors as OpenAI error objects: the neutral errors' mapping, body parsing, exception handlers.

Before the first token every error is a status code with `{"error": {...}}`; after it, the SSE
stream reports it in-band (http_stream.py).
"""

from __future__ import annotations

import json
import logging
import math
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.frontend.backend import QueueFullError
from deployments.frontend.openai_protocol import APIError
from deployments.frontend.prepare import UnknownModelError
from deployments.frontend.text_stream import GenerationFailed
from engine import InvalidRequestError

logger = logging.getLogger(__name__)

T = TypeVar("T")

# What `api_error` maps: preparation errors, backend refusals, backend failures.
NEUTRAL_ERRORS = (InvalidRequestError, QueueFullError, GenerationFailed)


def api_error(e: Exception, rename: dict[str, str] | None = None) -> APIError:
    """The OpenAI error for one of NEUTRAL_ERRORS; `rename` maps engine field names to this request's."""
    if isinstance(e, UnknownModelError):
        return APIError(404, f"The model {e.message}", "invalid_request_error", "model", "model_not_found")
    if isinstance(e, InvalidRequestError):
        return APIError.from_invalid(e, rename)
    if isinstance(e, QueueFullError):
        return APIError(429, str(e), "rate_limit_error", code="rate_limit_exceeded",
                        headers={"Retry-After": str(max(1, math.ceil(e.retry_after_s)))})
    if isinstance(e, GenerationFailed):
        return APIError(500, str(e), "server_error", code="generation_failed")
    raise TypeError(f"not a neutral error: {type(e).__name__}")


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.to_response().model_dump(), status_code=err.status_code, headers=err.headers)


def _validation_error(errors: list[dict]) -> APIError:
    """One 400 for pydantic errors: `param` is the first offending top-level field."""
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    msg = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}"
                    for e in errors[:5])
    return APIError.bad_request(msg or "invalid request body", loc[0] if loc else None, "invalid_value")


async def parse_body(request: Request, model: type[T]) -> T:
    """The body as `model`, whatever the Content-Type (curl -d sends form-urlencoded)."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError.bad_request(f"malformed JSON body: {e}", None, "invalid_json") from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise _validation_error(e.errors(include_url=False)) from None


async def _api_error_handler(request: Request, exc: APIError) -> JSONResponse:
    return error_response(exc)


async def _validation_error_handler(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = list(exc.errors())
    if errors and errors[0].get("type") == "json_invalid":
        return error_response(APIError.bad_request("malformed JSON body", None, "invalid_json"))
    return error_response(_validation_error(errors))


async def _http_error_handler(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return error_response(APIError(exc.status_code, str(exc.detail), kind, headers=dict(exc.headers or {})))


async def _unexpected_error_handler(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unexpected error on %s", request.url.path, exc_info=exc)
    return error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error"))


def add_error_handlers(app: FastAPI) -> None:
    """Every error the app can raise answers as an OpenAI error object (unknown routes too)."""
    app.add_exception_handler(APIError, _api_error_handler)
    app.add_exception_handler(RequestValidationError, _validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, _http_error_handler)
    app.add_exception_handler(Exception, _unexpected_error_handler)
