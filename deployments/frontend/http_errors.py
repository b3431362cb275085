"""HTTP errors as OpenAI error objects: the neutral errors' mapping and the exception handlers.

Before the first token every error is a status code with `{"error": {...}}`; after it, the SSE
stream reports it in-band (http_stream.py). A 5xx never carries exception text: the log does.
The body's own errors (413, malformed JSON, unknown fields, ...) are http_body.py's.
"""

from __future__ import annotations

import logging
import math

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.frontend.backend import QueueFullError
from deployments.frontend.http_body import validation_error
from deployments.frontend.openai_protocol import APIError
from deployments.frontend.prepare import UnknownModelError
from deployments.frontend.text_stream import GenerationFailed
from engine import InvalidRequestError

logger = logging.getLogger(__name__)

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
        return generation_failed(e)
    raise TypeError(f"not a neutral error: {type(e).__name__}")


def generation_failed(e: GenerationFailed) -> APIError:
    """500 for a request the backend failed. NOTE: the backend's reason can hold internal exception
    text (a worker's traceback summary): it goes to the log (text_stream.py), never to the client."""
    return APIError(500, f"generation failed for request {e.request_id}; the server log has the cause",
                    "server_error", code="generation_failed")


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.to_response().model_dump(), status_code=err.status_code, headers=err.headers)


async def _api_error_handler(request: Request, exc: APIError) -> JSONResponse:
    return error_response(exc)


async def _validation_error_handler(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = list(exc.errors())
    if errors and errors[0].get("type") == "json_invalid":
        return error_response(APIError.bad_request("malformed JSON body", None, "invalid_json"))
    return error_response(validation_error(errors))


async def _http_error_handler(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return error_response(APIError(exc.status_code, str(exc.detail), kind, headers=dict(exc.headers or {})))


async def _unexpected_error_handler(request: Request, exc: Exception) -> JSONResponse:
    # NOTE: the exception's text stays in the log; the client learns only that it was not its fault.
    logger.error("unexpected error on %s", request.url.path, exc_info=exc)
    return error_response(APIError(500, "internal server error; the server log has the cause", "server_error",
                                   code="internal_error"))


def add_error_handlers(app: FastAPI) -> None:
    """Every error the app can raise answers as an OpenAI error object (unknown routes too)."""
    app.add_exception_handler(APIError, _api_error_handler)
    app.add_exception_handler(RequestValidationError, _validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, _http_error_handler)
    app.add_exception_handler(Exception, _unexpected_error_handler)
