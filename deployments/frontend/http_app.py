"""The OpenAI-compatible HTTP app: schema checks, chat template, tokenization, streaming text.

`build_openai_app(...)` returns a plain FastAPI app; the Serve deployment mounts it with
`@serve.ingress(app)` and may attach the backend and tokenizer later with `configure_openai_app`
(everything the routes need lives in `app.state.pdserve`).

Per request:  body → prompt token ids → `backend.generate(...)` → TokenDeltas
              → IncrementalDetokenizer → StopStringFilter → JSON body or SSE chunks.
Errors before the first token become a status code (400/404/429/500/503); after it, an SSE error
chunk followed by `data: [DONE]`. A client that goes away aborts its backend request.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, TypeVar

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.frontend.backend import GenerateBackend, QueueFullError, TokenDelta
from deployments.frontend.openai_protocol import (
    APIError, AssistantMessage, ChatCompletionChoice, ChatCompletionRequest, ChatCompletionResponse,
    ChatCompletionStreamChoice, ChatCompletionStreamResponse, CompletionChoice, CompletionRequest,
    CompletionResponse, CompletionStreamResponse, DeltaMessage, ErrorInfo, ErrorResponse, ModelCard, ModelList,
    UsageInfo)
from engine import InvalidRequestError, SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")


# ---------------------------------------------------------------------- text from tokens
class IncrementalDetokenizer:
    """Token ids in, text deltas out; the deltas concatenate to `tokenizer.decode(all ids)`.

    Decodes a short window `ids[prefix_offset:]` against `ids[prefix_offset:read_offset]` (vLLM's
    prefix-offset scheme) so merged/multi-byte tokens come out whole: while the window ends in U+FFFD
    (an incomplete UTF-8 sequence) nothing is emitted.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip) if ids else ""

    def push(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        self.token_ids.extend(token_ids)
        prefix = self._decode(self.token_ids[self._prefix_offset:self._read_offset])
        window = self._decode(self.token_ids[self._prefix_offset:])
        if len(window) <= len(prefix) or window.endswith("\ufffd"):
            return ""  # NOTE: hold an incomplete character until the token that completes it
        delta = window[len(prefix):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of the sequence: whatever is still held, as the full decode has it."""
        full = self._decode(self.token_ids)
        if len(full) <= len(self.text) or not full.startswith(self.text):
            return ""
        delta, self.text = full[len(self.text):], full
        return delta


class StopStringFilter:
    """Cuts streamed text at the first stop string.

    NOTE: text that could be the start of a stop string is held back until it is known not to be, so
    no part of a stop string is ever sent.
    """

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self._max_hold = max((len(s) for s in self.stops), default=1) - 1
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to send, whether a stop string was hit). After a hit, send nothing more."""
        if not self.stops:
            return text, False
        buf = self._held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i != -1]
        if hits:
            self._held = ""
            return buf[:min(hits)], True
        hold = 0
        for k in range(min(len(buf), self._max_hold), 0, -1):
            if any(s.startswith(buf[-k:]) for s in self.stops):
                hold = k
                break
        self._held = buf[len(buf) - hold:]
        return buf[:len(buf) - hold], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held


class BackendFailed(Exception):
    """The backend reported an error after the request was accepted."""


class TextStream:
    """One request's generation as OpenAI text: (text delta, finish_reason) events plus usage counts."""

    def __init__(self, backend: GenerateBackend, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams, priority: int, tokenizer: Any):
        self.backend = backend
        self.request_id = request_id
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_completion_tokens = 0
        self.num_cached_tokens = 0  # from the first event: what the (first) prefill found cached
        self.finish_reason: str | None = None
        self._detok = IncrementalDetokenizer(tokenizer)
        self._stops = StopStringFilter(params.stop)
        self._gen = backend.generate(request_id, prompt_token_ids, params, priority)
        self._first: TokenDelta | None = None
        self._done = False  # the backend has nothing more for this request

    async def start(self) -> None:
        """Wait for the first event. Raises what the backend raises before accepting the request."""
        try:
            self._first = await self._gen.__anext__()
        except StopAsyncIteration:
            self._done = True
            raise APIError(500, "the backend ended the request without output", "server_error") from None
        except Exception:
            self._done = True  # rejected (queue full, invalid): never accepted, nothing to abort
            raise
        first = self._first
        self.num_cached_tokens = first.num_cached_tokens
        if first.finished and first.finish_reason == "error" and not first.token_ids:
            self._done = True
            raise APIError(500, f"generation failed: {first.error}", "server_error")

    async def events(self) -> AsyncIterator[tuple[str, str | None]]:
        """Yields (text, None) while generating and one last (text, finish_reason); text may be ""."""
        assert self._first is not None, "call start() first"
        delta, self._first = self._first, None
        while True:
            self.num_completion_tokens += len(delta.token_ids)
            text = self._detok.push(delta.token_ids)
            if delta.finished:
                self._done = True
                text += self._detok.flush()
            out, stopped = self._stops.feed(text)
            if stopped:
                if not self._done:
                    self._done = True
                    await self.backend.abort(self.request_id)
                self.finish_reason = "stop"
                yield out, "stop"
                return
            if delta.finished:
                out += self._stops.flush()
                if delta.finish_reason == "error":
                    if out:
                        yield out, None
                    raise BackendFailed(delta.error or "generation failed")
                self.finish_reason = delta.finish_reason or "stop"
                yield out, self.finish_reason
                return
            if out:
                yield out, None
            try:
                delta = await self._gen.__anext__()
            except StopAsyncIteration:
                self._done = True
                raise BackendFailed("the backend stream ended before the request finished") from None

    async def close(self) -> None:
        """Abort the backend request unless it finished; safe to call from a cancelled task."""
        with anyio.CancelScope(shield=True):
            if not self._done:
                self._done = True
                await self.backend.abort(self.request_id)
            await self._gen.aclose()

    @property
    def usage(self) -> UsageInfo:
        return UsageInfo.of(self.num_prompt_tokens, self.num_completion_tokens, self.num_cached_tokens)


# ---------------------------------------------------------------------- app state
@dataclass
class IngressState:
    """Everything the routes need; set at build time or later with `configure_openai_app`."""

    backend: GenerateBackend | None = None
    tokenizer: Any = None
    model_name: str = "pdserve"
    max_model_len: int | None = None
    api_key: str | None = None
    # Longest wait for the first token before the request is dropped with 503 (None: no limit).
    max_queue_wait_s: float | None = None
    vocab_size: int | None = None

    def ready(self) -> tuple[GenerateBackend, Any, int]:
        if self.backend is None or self.tokenizer is None or self.max_model_len is None:
            raise APIError(503, "the server is starting; retry shortly", "server_error", code="not_ready",
                           headers={"Retry-After": "1"})
        return self.backend, self.tokenizer, self.max_model_len


def build_openai_app(backend: GenerateBackend | None = None, tokenizer: Any = None, model_name: str = "pdserve",
                     max_model_len: int | None = None, api_key: str | None = None,
                     max_queue_wait_s: float | None = None, vocab_size: int | None = None) -> FastAPI:
    """A FastAPI app serving /v1/completions, /v1/chat/completions, /v1/models and /health.

    All arguments may be left out here and set later with `configure_openai_app` (e.g. in a Serve
    deployment's __init__); until backend, tokenizer and max_model_len are set, /v1 answers 503.
    api_key: when set, /v1/* requires `Authorization: Bearer <api_key>`; /health stays open.
    """
    app = FastAPI(title="pdserve", description="OpenAI-compatible LLM serving with disaggregated prefill/decode")
    app.state.pdserve = IngressState()
    configure_openai_app(app, backend=backend, tokenizer=tokenizer, model_name=model_name,
                         max_model_len=max_model_len, api_key=api_key, max_queue_wait_s=max_queue_wait_s,
                         vocab_size=vocab_size)
    app.add_middleware(_BearerAuth)
    app.add_exception_handler(APIError, _api_error_handler)
    app.add_exception_handler(RequestValidationError, _validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, _http_error_handler)
    app.add_exception_handler(Exception, _unexpected_error_handler)
    # Bodies are parsed by the routes themselves, so any Content-Type works (curl -d sends a form type).
    app.add_api_route("/v1/completions", _completions, methods=["POST"], response_model=None)
    app.add_api_route("/v1/chat/completions", _chat_completions, methods=["POST"], response_model=None)
    app.add_api_route("/v1/models", _models, methods=["GET"], response_model=None)
    app.add_api_route("/health", _health, methods=["GET"], response_model=None)
    return app


_UNSET: Any = object()


def configure_openai_app(app: FastAPI, *, backend: GenerateBackend | None = _UNSET, tokenizer: Any = _UNSET,
                         model_name: str = _UNSET, max_model_len: int | None = _UNSET, api_key: str | None = _UNSET,
                         max_queue_wait_s: float | None = _UNSET, vocab_size: int | None = _UNSET) -> IngressState:
    """Set (some of) the app's serving state; arguments left out keep their value."""
    state: IngressState = app.state.pdserve
    for name, value in dict(backend=backend, tokenizer=tokenizer, model_name=model_name, max_model_len=max_model_len,
                            api_key=api_key, max_queue_wait_s=max_queue_wait_s, vocab_size=vocab_size).items():
        if value is not _UNSET:
            setattr(state, name, value)
    if state.tokenizer is not None and state.vocab_size is None:
        state.vocab_size = len(state.tokenizer)
    return state


def _state(request: Request) -> IngressState:
    return request.app.state.pdserve


# ---------------------------------------------------------------------- auth and errors
class _BearerAuth:
    """ASGI middleware: `Authorization: Bearer <api_key>` on everything but /health when a key is set."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and not scope["path"].endswith("/health"):
            key = scope["app"].state.pdserve.api_key
            if key:
                header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
                scheme, _, token = header.partition(" ")
                if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
                    err = APIError(401, "missing or invalid API key: send `Authorization: Bearer <key>`",
                                   "invalid_request_error", code="invalid_api_key")
                    await _error_response(err)(scope, receive, send)
                    return
        await self.app(scope, receive, send)


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.to_response().model_dump(), status_code=err.status_code, headers=err.headers)


async def _api_error_handler(request: Request, exc: APIError) -> JSONResponse:
    return _error_response(exc)


def _validation_error(errors: list[dict]) -> APIError:
    """One 400 for pydantic errors: `param` is the first offending top-level field."""
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    msg = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}"
                    for e in errors[:5])
    return APIError.bad_request(msg or "invalid request body", loc[0] if loc else None, "invalid_value")


async def _validation_error_handler(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = list(exc.errors())
    if errors and errors[0].get("type") == "json_invalid":
        return _error_response(APIError.bad_request("malformed JSON body", None, "invalid_json"))
    return _error_response(_validation_error(errors))


async def _parse_body(request: Request, model: type[T]) -> T:
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


async def _http_error_handler(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return _error_response(APIError(exc.status_code, str(exc.detail), kind, headers=dict(exc.headers or {})))


async def _unexpected_error_handler(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unexpected error on %s", request.url.path, exc_info=exc)
    return _error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error"))


def _check_model(state: IngressState, model: str | None) -> str:
    if model is not None and model != state.model_name:
        raise APIError(404, f"The model `{model}` does not exist; this server serves `{state.model_name}`",
                       "invalid_request_error", "model", "model_not_found")
    return state.model_name


# ---------------------------------------------------------------------- client disconnects
class _ClientGone(Exception):
    pass


class _WaitExpired(Exception):
    pass


async def _wait_for_disconnect(request: Request) -> None:
    # The body is already read, so the next ASGI message is the disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Request, aw: Awaitable[T], timeout_s: float | None = None) -> T:
    """Await `aw`, cancelling it if the client disconnects (_ClientGone) or `timeout_s` passes (_WaitExpired)."""
    task = asyncio.ensure_future(aw)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task in done:
        return task.result()
    if watcher in done:
        raise _ClientGone()
    raise _WaitExpired()


async def _start(request: Request, stream: TextStream, state: IngressState, rename: dict[str, str]) -> None:
    """Wait for the first token, turning the backend's refusals into HTTP errors."""
    try:
        await _unless_disconnected(request, stream.start(), state.max_queue_wait_s)
    except QueueFullError as e:
        raise APIError(429, str(e), "rate_limit_error", code="rate_limit_exceeded",
                       headers={"Retry-After": str(max(1, math.ceil(e.retry_after_s)))}) from None
    except InvalidRequestError as e:
        raise APIError.from_invalid(e, rename) from None
    except _WaitExpired:
        await stream.close()
        raise APIError(503, f"no capacity within {state.max_queue_wait_s}s; retry later", "server_error",
                       code="queue_timeout", headers={"Retry-After": "1"}) from None


class _SSEResponse(StreamingResponse):
    """StreamingResponse that always closes its generator, so a vanished client aborts the request."""

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()


def _sse(payload: Any) -> str:
    data = payload.model_dump_json() if hasattr(payload, "model_dump_json") else payload
    return f"data: {data}\n\n"


def _sse_error(message: str) -> str:
    err = ErrorResponse(error=ErrorInfo(message=message, type="server_error", code="generation_failed"))
    return _sse(err)


_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


# ---------------------------------------------------------------------- routes
async def _completions(request: Request) -> Response:
    body = await _parse_body(request, CompletionRequest)
    state = _state(request)
    backend, tokenizer, max_model_len = state.ready()
    model = _check_model(state, body.model)
    prompt = body.single_prompt()
    if isinstance(prompt, str):
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    else:
        if any(t < 0 or t >= state.vocab_size for t in prompt):
            raise APIError.bad_request(f"prompt: token ids must be in [0, {state.vocab_size})", "prompt",
                                       "invalid_value")
        prompt_ids = list(prompt)
    if not prompt_ids:
        raise APIError.bad_request("prompt: encodes to no tokens", "prompt", "invalid_value")
    params = body.sampling_params(len(prompt_ids), max_model_len)
    rid = f"cmpl-{uuid.uuid4().hex}"
    stream = TextStream(backend, rid, prompt_ids, params, body.priority, tokenizer)
    return await _respond(request, state, stream, body.stream, body.include_usage_in_stream, model, chat=False)


async def _chat_completions(request: Request) -> Response:
    body = await _parse_body(request, ChatCompletionRequest)
    state = _state(request)
    backend, tokenizer, max_model_len = state.ready()
    model = _check_model(state, body.model)
    messages = body.template_messages()
    try:
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except Exception as e:  # jinja's raise_exception (e.g. roles must alternate), no template, ...
        raise APIError.bad_request(f"messages: the chat template rejected them: {e}", "messages",
                                   "invalid_value") from None
    prompt_ids = list(out if isinstance(out, list) else out["input_ids"])
    params = body.sampling_params(len(prompt_ids), max_model_len)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    stream = TextStream(backend, rid, prompt_ids, params, body.priority, tokenizer)
    return await _respond(request, state, stream, body.stream, body.include_usage_in_stream, model, chat=True)


async def _respond(request: Request, state: IngressState, stream: TextStream, streaming: bool | None,
                   include_usage: bool, model: str, chat: bool) -> Response:
    rename = {"prompt": "messages"} if chat else {}
    try:
        await _start(request, stream, state, rename)
    except _ClientGone:
        await stream.close()
        return Response(status_code=499)
    except BaseException:
        await stream.close()
        raise
    if streaming:
        gen = _chat_sse(stream, model, include_usage) if chat else _completion_sse(stream, model, include_usage)
        return _SSEResponse(gen, headers=_SSE_HEADERS)
    try:
        text = await _unless_disconnected(request, _collect(stream))
    except _ClientGone:
        return Response(status_code=499)
    except BackendFailed as e:
        raise APIError(500, f"generation failed: {e}", "server_error", code="generation_failed") from None
    finally:
        await stream.close()
    if chat:
        return _json(ChatCompletionResponse(
            id=stream.request_id, model=model, usage=stream.usage,
            choices=[ChatCompletionChoice(message=AssistantMessage(content=text), finish_reason=stream.finish_reason)]))
    return _json(CompletionResponse(
        id=stream.request_id, model=model, usage=stream.usage,
        choices=[CompletionChoice(text=text, finish_reason=stream.finish_reason)]))


def _json(model: Any) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


async def _collect(stream: TextStream) -> str:
    return "".join([text async for text, _ in stream.events()])


async def _completion_sse(stream: TextStream, model: str, include_usage: bool) -> AsyncIterator[str]:
    rid = stream.request_id
    try:
        try:
            async for text, finish in stream.events():
                yield _sse(CompletionStreamResponse(
                    id=rid, model=model, choices=[CompletionChoice(text=text, finish_reason=finish)]))
            if include_usage:
                yield _sse(CompletionStreamResponse(id=rid, model=model, choices=[], usage=stream.usage))
        except Exception as e:  # after the first chunk the status is sent: report in-band
            if not isinstance(e, BackendFailed):
                logger.exception("stream %s failed", rid)
            yield _sse_error(f"generation failed: {e}")
        yield "data: [DONE]\n\n"
    finally:
        await stream.close()


async def _chat_sse(stream: TextStream, model: str, include_usage: bool) -> AsyncIterator[str]:
    rid = stream.request_id

    def chunk(delta: DeltaMessage, finish: str | None = None) -> str:
        return _sse(ChatCompletionStreamResponse(
            id=rid, model=model, choices=[ChatCompletionStreamChoice(delta=delta, finish_reason=finish)]))

    try:
        try:
            yield chunk(DeltaMessage(role="assistant", content=""))
            async for text, finish in stream.events():
                yield chunk(DeltaMessage(content=text or None), finish)
            if include_usage:
                yield _sse(ChatCompletionStreamResponse(id=rid, model=model, choices=[], usage=stream.usage))
        except Exception as e:
            if not isinstance(e, BackendFailed):
                logger.exception("stream %s failed", rid)
            yield _sse_error(f"generation failed: {e}")
        yield "data: [DONE]\n\n"
    finally:
        await stream.close()


async def _models(request: Request) -> Response:
    state = _state(request)
    return _json(ModelList(data=[ModelCard(id=state.model_name, max_model_len=state.max_model_len)]))


async def _health(request: Request) -> Response:
    state = _state(request)
    if state.backend is None:
        return JSONResponse({"status": "starting"}, status_code=503)
    try:
        info = await state.backend.health()
    except Exception as e:
        return JSONResponse({"status": "unhealthy", "error": f"{type(e).__name__}: {e}"}, status_code=503)
    ok = info.get("status", "ok") == "ok"
    return JSONResponse({"model": state.model_name, **info}, status_code=200 if ok else 503)
