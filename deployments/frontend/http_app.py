"""The OpenAI-compatible HTTP app: app state, routes, and the wiring of the HTTP modules.

`build_openai_app(...)` returns a plain FastAPI app; the Serve deployment (deployments/app.py)
mounts it and may attach the backend and tokenizer later with `configure_openai_app` (everything
the routes need lives in `app.state.pdserve`).

Per request:  body (openai_protocol.py) → prepare.py: prompt token ids + SamplingParams (per prompt)
              → fanout.FanOut: one text_stream.TextStream per choice (prompts × n) over `backend.generate`
              → openai_choices.py: choice objects (echo, logprobs) → http_stream.py: JSON or SSE.
Errors answer as OpenAI error objects (http_errors.py); the body is read and checked by http_body.py;
the API key is checked by http_auth.py.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from deployments import tracing
from deployments.frontend.backend import GenerateBackend
from deployments.frontend.auth import bearer_matches
from deployments.frontend.http_auth import BearerAuth
from deployments.frontend.http_body import BODY_TIMEOUT_S, INLINE_PARSE_BYTES, MAX_BODY_BYTES, parse_body
from deployments.frontend.http_errors import add_error_handlers, api_error
from deployments.frontend.http_stream import ResponseOptions, respond
from deployments.frontend.openai_protocol import APIError, ChatCompletionRequest, CompletionRequest
from deployments.frontend.openai_responses import ModelCard, ModelList
from deployments.frontend.fanout import FanOut
from deployments.frontend.openai_choices import ChoiceFormatter, ChoiceOptions
from deployments.frontend.prepare import PromptInput, PromptKind, ServedModel, prepare, prepare_off_loop
from deployments.frontend.tenants import Tenant, TenantBook, admit_call
from engine import InvalidRequestError


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
    vocab_size: int | None = None  # the model's; None: the tokenizer's size (see ServedModel.of)
    scheduling_policy: str = "fcfs"  # the engines' (EngineConfig.scheduling_policy): fcfs refuses a priority
    max_body_bytes: int = MAX_BODY_BYTES  # larger bodies get 413
    body_timeout_s: float | None = BODY_TIMEOUT_S  # a body not whole this long after its headers: 408
    # Several API keys, each a tenant with its share (tenants.py); None: `api_key` alone, no tenants.
    tenants: TenantBook | None = None
    # One call's prompts x n x (prompt + max_tokens) tokens at most (None: no cap); more is a 400.
    max_request_tokens: int | None = None
    # Derived by `configure_openai_app` once tokenizer and max_model_len are known.
    served_model: ServedModel | None = None

    def authorize(self, authorization: str | None) -> tuple[bool, Tenant | None]:
        """Whether `authorization` may use /v1, and its tenant: a tenant's key, or `api_key` (no tenant)."""
        tenant = self.tenants.identify(authorization) if self.tenants is not None else None
        if tenant is not None:
            return True, tenant
        if self.tenants is not None and not self.api_key:
            return False, None
        return bearer_matches(authorization, self.api_key), None

    def ready(self) -> tuple[GenerateBackend, ServedModel]:
        if self.backend is None or self.served_model is None:
            raise APIError(503, "the server is starting; retry shortly", "server_error", code="not_ready",
                           headers={"Retry-After": "1"})
        return self.backend, self.served_model


def build_openai_app(backend: GenerateBackend | None = None, tokenizer: Any = None, model_name: str = "pdserve",
                     max_model_len: int | None = None, api_key: str | None = None,
                     max_queue_wait_s: float | None = None, vocab_size: int | None = None,
                     scheduling_policy: str = "fcfs", tenants: TenantBook | None = None,
                     max_request_tokens: int | None = None) -> FastAPI:
    """A FastAPI app serving /v1/completions, /v1/chat/completions, /v1/models and /health.

    All arguments may be left out here and set later with `configure_openai_app` (e.g. in a Serve
    deployment's __init__); until backend, tokenizer and max_model_len are set, /v1 answers 503.
    api_key: when set, /v1/* requires `Authorization: Bearer <api_key>`; /health stays open but
        shows the backend's details only with the key (without it: just whether the server is up).
    vocab_size: prompt token ids must lie in [0, vocab_size); None: the tokenizer's size.
    tenants: several API keys, each a tenant (tenants.py); with `api_key` too, that key stays valid
        without a tenant.
    max_request_tokens: the most tokens one call may ask for, prompts x n x (prompt + max_tokens).
    """
    app = FastAPI(title="pdserve", description="OpenAI-compatible LLM serving with disaggregated prefill/decode")
    app.state.pdserve = IngressState()
    configure_openai_app(app, backend=backend, tokenizer=tokenizer, model_name=model_name,
                         max_model_len=max_model_len, api_key=api_key, max_queue_wait_s=max_queue_wait_s,
                         vocab_size=vocab_size, scheduling_policy=scheduling_policy, tenants=tenants,
                         max_request_tokens=max_request_tokens)
    app.add_middleware(BearerAuth)
    add_error_handlers(app)
    # Bodies are parsed by the routes themselves, so any Content-Type works (curl -d sends a form type).
    app.add_api_route("/v1/completions", _completions, methods=["POST"], response_model=None)
    app.add_api_route("/v1/chat/completions", _chat_completions, methods=["POST"], response_model=None)
    app.add_api_route("/v1/models", _models, methods=["GET"], response_model=None)
    app.add_api_route("/health", _health, methods=["GET"], response_model=None)
    return app


_UNSET: Any = object()


def configure_openai_app(app: FastAPI, *, backend: GenerateBackend | None = _UNSET, tokenizer: Any = _UNSET,
                         model_name: str = _UNSET, max_model_len: int | None = _UNSET, api_key: str | None = _UNSET,
                         max_queue_wait_s: float | None = _UNSET, vocab_size: int | None = _UNSET,
                         scheduling_policy: str = _UNSET, tenants: TenantBook | None = _UNSET,
                         max_request_tokens: int | None = _UNSET) -> IngressState:
    """Set (some of) the app's serving state; arguments left out keep their value."""
    state: IngressState = app.state.pdserve
    for name, value in dict(backend=backend, tokenizer=tokenizer, model_name=model_name, max_model_len=max_model_len,
                            api_key=api_key, max_queue_wait_s=max_queue_wait_s, vocab_size=vocab_size,
                            scheduling_policy=scheduling_policy, tenants=tenants,
                            max_request_tokens=max_request_tokens).items():
        if value is not _UNSET:
            setattr(state, name, value)
    state.served_model = None
    if state.tokenizer is not None and state.max_model_len is not None:
        state.served_model = ServedModel.of(state.model_name, state.tokenizer, state.max_model_len, state.vocab_size,
                                            state.scheduling_policy)
    return state


def _state(request: Request) -> IngressState:
    return request.app.state.pdserve


# ---------------------------------------------------------------------- routes
async def _completions(request: Request) -> Response:
    t0 = time.time_ns()
    body = await parse_body(request, CompletionRequest, _state(request).max_body_bytes, _state(request).body_timeout_s)
    return await _traced(request, body, False, t0)


async def _chat_completions(request: Request) -> Response:
    t0 = time.time_ns()
    body = await parse_body(request, ChatCompletionRequest, _state(request).max_body_bytes,
                             _state(request).body_timeout_s)
    return await _traced(request, body, True, t0)


async def _traced(request: Request, body: CompletionRequest | ChatCompletionRequest, chat: bool,
                  t0: int) -> Response:
    """`_generate` inside the request's trace when tracing is on (deployments/tracing.py): the root span
    starts when the body began to arrive, under the client's `traceparent` if it sent one."""
    if not tracing.enabled():
        return await _generate(request, body, chat)
    rt = tracing.begin_request("request", request.headers, t0, {"http.route": request.url.path, "chat": chat,
                                                               "stream": bool(body.stream)})
    tracing.record("door.parse", rt.span, t0, attributes={"body_bytes": getattr(request.state, "body_bytes", None)})
    try:
        return await _generate(request, body, chat)
    except BaseException as e:
        tracing.end_request(rt, type(e).__name__)
        raise


async def _generate(request: Request, body: CompletionRequest | ChatCompletionRequest, chat: bool) -> Response:
    state = _state(request)
    backend, model = state.ready()
    t_prepare = time.time_ns()
    try:
        model_name = model.check_name(body.model)
        if getattr(request.state, "body_bytes", 0) > INLINE_PARSE_BYTES:
            # NOTE: a large body is prepared on a worker thread whatever field makes it large (a chat
            # role, tools, a schema, many prompts): the event loop keeps serving streams and /health.
            prompts, sampling, prepared = await asyncio.to_thread(_prepare_body, model, body, chat)
        else:
            prompts = [body.prompt_input()] if chat else body.prompt_inputs()
            sampling = body.sampling_input()
            prepared = [await prepare_off_loop(model, p, sampling, body.priority or 0, body.cache_salt)
                        for p in prompts]
    except InvalidRequestError as e:
        raise api_error(e) from None
    prepared, admission = admit_call(state.tenants, getattr(request.state, "tenant", None), prepared,
                                     body.num_samples, state.max_request_tokens)
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    if (rt := tracing.current()) is not None:
        rt.span.set_attribute("request_id", request_id)
        tracing.record("door.prepare", rt.span, t_prepare, attributes={
            "prompts": len(prepared), "prompt_tokens": sum(len(p.prompt_token_ids) for p in prepared),
            "structured_output": any(p.params.structured is not None for p in prepared)})
    score_only = not chat and body.score_only
    try:
        stream = FanOut(backend, request_id, prepared, body.num_samples, model.tokenizer, score_only=score_only,
                        on_close=admission.release)
    except BaseException:
        admission.release()
        raise
    echo = None if chat or not body.echo else [_echo_text(model, p) for p in prompts]
    tools = body.tool_plan().output if chat else None  # checked by sampling_input() above
    fmt = ChoiceFormatter(stream, model.tokenizer, ChoiceOptions(chat, sampling.logprobs is not None, echo, tools))
    opts = ResponseOptions(model=model_name, chat=chat, streaming=bool(body.stream),
                           include_usage=body.include_usage_in_stream, max_queue_wait_s=state.max_queue_wait_s)
    return await respond(request, stream, fmt, opts)


def _prepare_body(model: ServedModel, body: CompletionRequest | ChatCompletionRequest, chat: bool):
    """Every step of a body's preparation, in one call (for a worker thread)."""
    prompts = [body.prompt_input()] if chat else body.prompt_inputs()
    sampling = body.sampling_input()
    return prompts, sampling, [prepare(model, p, sampling, body.priority or 0, body.cache_salt) for p in prompts]


def _echo_text(model: ServedModel, prompt: PromptInput) -> str:
    """What `echo` puts before a completion: the prompt as sent (token ids: decoded, special tokens kept)."""
    if prompt.kind is PromptKind.TEXT:
        return prompt.value
    return model.tokenizer.decode(prompt.value, skip_special_tokens=False)


async def _models(request: Request) -> Response:
    state = _state(request)
    body = ModelList(data=[ModelCard(id=state.model_name, max_model_len=state.max_model_len)])
    return Response(body.model_dump_json(), media_type="application/json")


async def _health(request: Request) -> Response:
    """Up or not for anyone (load balancers' probes carry no key); the backend's details (the router's
    pools, queues, errors) only with the API key when one is set."""
    state = _state(request)
    if state.backend is None:
        return JSONResponse({"status": "starting"}, status_code=503)
    try:
        info = await state.backend.health()
    except Exception as e:  # noqa: BLE001 - the answer is "unhealthy", whatever broke
        info = {"status": "unhealthy", "error": f"{type(e).__name__}: {e}"}
    status = str(info.get("status", "ok"))
    code = 200 if status == "ok" else 503
    if not state.authorize(request.headers.get("authorization"))[0]:
        return JSONResponse({"status": status}, status_code=code)
    return JSONResponse({"model": state.model_name, **info, "status": status}, status_code=code)
