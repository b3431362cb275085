"""One generate request's HTTP answer: wait for the first token, then a JSON body or SSE chunks.

Errors before the first token become a status code (400/429/500/503); after it, an SSE error chunk
followed by `data: [DONE]`. A client that goes away aborts its backend request: a disconnect seen
while waiting (non-streaming, or before the first token) answers 499, and a streaming response
always closes its `FanOut` (the request's choices), which aborts whatever did not finish.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from deployments.frontend.fanout import ChoiceChunk, FanOut
from deployments.frontend.http_errors import NEUTRAL_ERRORS, api_error, generation_failed
from deployments.frontend.openai_choices import ChoiceFormatter
from deployments.frontend.openai_protocol import APIError
from deployments.frontend.openai_responses import (
    ChatCompletionResponse, ChatCompletionStreamResponse, CompletionResponse, CompletionStreamResponse, UsageInfo)
from deployments.frontend.text_stream import GenerationFailed

logger = logging.getLogger(__name__)

T = TypeVar("T")

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_DONE = "data: [DONE]\n\n"


@dataclass(frozen=True, slots=True)
class ResponseOptions:
    """How to answer one request (from its body and the app's settings)."""

    model: str  # the served model's name, echoed in every response
    chat: bool  # chat.completion objects rather than text_completion
    streaming: bool
    include_usage: bool  # streaming only: a last chunk with usage (stream_options.include_usage)
    max_queue_wait_s: float | None  # longest wait for the first token (None: no limit)


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


# ---------------------------------------------------------------------- the answer
async def respond(request: Request, stream: FanOut, fmt: ChoiceFormatter, opts: ResponseOptions) -> Response:
    """Start `stream` (every choice of the request) and answer with it; it is closed on every path."""
    try:
        await _start(request, stream, opts)
    except _ClientGone:
        await stream.close()
        return Response(status_code=499)
    except BaseException:
        await stream.close()
        raise
    if opts.streaming:
        body = _chat_chunks(stream, fmt, opts) if opts.chat else _completion_chunks(stream, fmt, opts)
        return _SSEResponse(stream, _sse_body(stream, body), headers=_SSE_HEADERS)
    try:
        chunks = await _unless_disconnected(request, _collect(stream))
    except _ClientGone:
        return Response(status_code=499)
    except GenerationFailed as e:
        raise api_error(e) from None
    finally:
        await stream.close()
    usage = _usage(stream)
    if opts.chat:
        return _json(ChatCompletionResponse(id=stream.request_id, model=opts.model, usage=usage,
                                            choices=fmt.chat_choices(chunks)))
    return _json(CompletionResponse(id=stream.request_id, model=opts.model, usage=usage,
                                    choices=fmt.completion_choices(chunks)))


async def _start(request: Request, stream: FanOut, opts: ResponseOptions) -> None:
    """Wait for the first token, turning the backend's refusals into HTTP errors."""
    try:
        await _unless_disconnected(request, stream.start(), opts.max_queue_wait_s)
    except NEUTRAL_ERRORS as e:
        # The engine names the prompt `prompt`; a chat request's prompt is its `messages`.
        raise api_error(e, {"prompt": "messages"} if opts.chat else None) from None
    except _WaitExpired:
        await stream.close()
        raise APIError(503, f"no capacity within {opts.max_queue_wait_s}s; retry later", "server_error",
                       code="queue_timeout", headers={"Retry-After": "1"}) from None


def _json(model: Any) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


def _usage(stream: FanOut) -> UsageInfo:
    return UsageInfo.of(*stream.usage)


async def _collect(stream: FanOut) -> list[ChoiceChunk]:
    return [chunk async for chunk in stream.chunks()]


# ---------------------------------------------------------------------- server-sent events
class _SSEResponse(StreamingResponse):
    """StreamingResponse that always closes its generator and its stream, so a vanished client aborts
    the request. NOTE: the stream is closed here too: closing a generator that never started (the
    client left before the first chunk was sent) does not run its `finally`."""

    media_type = "text/event-stream"

    def __init__(self, stream: FanOut, content: AsyncIterator[str], headers: dict[str, str]):
        super().__init__(content, headers=headers)
        self.stream = stream

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    await self.body_iterator.aclose()
                finally:
                    await self.stream.close()


# Line separators other than CR / LF, escaped in every event (still the same JSON): SSE ends a line only
# at CR or LF, but a client that splits lines with Python's str.splitlines() would cut an event at a raw
# U+0085 / U+2028 / U+2029 in generated or echoed text (found by tests/deployments/test_edge_fuzz.py).
_LINE_SEPARATORS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _sse(payload: Any) -> str:
    data = payload.model_dump_json()
    if not data.isascii():
        data = data.translate(_LINE_SEPARATORS)
    return f"data: {data}\n\n"


async def _sse_body(stream: FanOut, events: AsyncIterator[str]) -> AsyncIterator[str]:
    """`events`, then `[DONE]`; a failure after the first chunk (the status is sent) is reported in-band."""
    try:
        try:
            async for event in events:
                yield event
        except Exception as e:  # noqa: BLE001 - the status is sent: report in-band, never the exception's text
            if not isinstance(e, GenerationFailed):
                logger.exception("stream %s failed", stream.request_id)
                e = GenerationFailed("unexpected error", stream.request_id)
            yield _sse(generation_failed(e).to_response())
        yield _DONE
    finally:
        with anyio.CancelScope(shield=True):
            await events.aclose()
            await stream.close()


async def _completion_chunks(stream: FanOut, fmt: ChoiceFormatter, opts: ResponseOptions) -> AsyncIterator[str]:
    rid, model = stream.request_id, opts.model
    async for chunk in stream.chunks():
        choice = fmt.completion(chunk)
        if choice is not None:
            yield _sse(CompletionStreamResponse(id=rid, model=model, choices=[choice]))
    if opts.include_usage:
        yield _sse(CompletionStreamResponse(id=rid, model=model, choices=[], usage=_usage(stream)))


async def _chat_chunks(stream: FanOut, fmt: ChoiceFormatter, opts: ResponseOptions) -> AsyncIterator[str]:
    rid, model = stream.request_id, opts.model
    for role in fmt.chat_roles():
        yield _sse(ChatCompletionStreamResponse(id=rid, model=model, choices=[role]))
    async for chunk in stream.chunks():
        choice = fmt.chat_delta(chunk)
        if choice is not None:
            yield _sse(ChatCompletionStreamResponse(id=rid, model=model, choices=[choice]))
    if opts.include_usage:
        yield _sse(ChatCompletionStreamResponse(id=rid, model=model, choices=[], usage=_usage(stream)))
