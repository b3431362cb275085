"""The generate call as a server-streaming gRPC service (`pdserve.Generation`) behind Serve's gRPC proxy.

```
grpc client ──/pdserve.Generation/Generate──▶ Serve gRPC proxy ──(metadata `application`)──▶
    GRPCIngress.Generate(request, grpc_context) ──▶ prepare.py: prompt token ids + SamplingParams
        ──▶ text_stream.TextStream over GenerateBackend.generate ──▶ stream of GenerateResponse chunks
```

The HTTP app shares both halves (prepare.py, text_stream.py); this module only maps the protobuf
request to their neutral inputs, their chunks to protobuf, and their errors to status codes.

Serve maps the RPC's method name to the deployment method of the same name (`Generate`, `Health`);
the proxy only serves the services registered through `gRPCOptions.grpc_servicer_functions`, so start
Serve with `serve.start(grpc_options=grpc_options(port))`. Status codes: the method sets them on the
`RayServegRPCContext` and raises, which Serve turns into the call's status.

Wiring (the backend comes from a factory, called once in each replica's __init__):

    serve.start(grpc_options=grpc_options(9000))
    serve.run(GRPCIngress.bind(local_engine_factory(model_name="smollm2")), name="pdserve-grpc",
              route_prefix="/pdserve-grpc")
    # NOTE: the proxy only routes to apps that have a route_prefix (None hides the app from gRPC
    # too), and an HTTP app usually holds "/": give the gRPC app its own prefix.
    # client: stub.Generate(req, metadata=(("application", "pdserve-grpc"),))
    # with an API key: GRPCIngress.bind(factory, api_key="KEY") and the client adds
    # ("authorization", "Bearer KEY") to its metadata.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import time
import uuid
from typing import Any, AsyncIterator, Callable, NamedTuple

import grpc
from ray import serve
from ray.serve.config import gRPCOptions
from ray.serve.grpc_util import RayServegRPCContext

from google.protobuf import unknown_fields

from deployments import tracing
from deployments.frontend.auth import bearer_matches
from deployments.frontend.backend import GenerateBackend, LocalEngineBackend, QueueFullError
from deployments.frontend.fanout import MAX_N, FanOut
from deployments.frontend.grpc import pdserve_pb2
from deployments.frontend.logprobs_format import TokenText, clamp
from deployments.frontend.openai_protocol import APIError
from deployments.frontend.prepare import (
    PreparedRequest, PromptInput, PromptKind, SamplingInput, ServedModel, UnknownModelError, prepare_off_loop)
from deployments.frontend.structured_request import spec_from_grpc
from deployments.frontend.tenants import Tenant, TenantBook, admit_call
from deployments.frontend.text_stream import GenerationFailed, Usage
from engine import InvalidRequestError
from engine.structured import StructuredSpec

logger = logging.getLogger(__name__)

# The import path Serve's proxy loads to register the service.
SERVICER_FUNCTION = "deployments.frontend.grpc.pdserve_pb2_grpc.add_GenerationServicer_to_server"
DEFAULT_APP_NAME = "pdserve-grpc"


class ServingState(NamedTuple):
    """What a backend factory returns (a plain 4- or 5-tuple in this order works too)."""

    backend: GenerateBackend
    tokenizer: Any  # a transformers tokenizer: encode, decode, apply_chat_template, len()
    model_name: str
    max_model_len: int
    vocab_size: int | None = None  # the model's; None: the tokenizer's size (see ServedModel.of)
    scheduling_policy: str = "fcfs"  # the engines' (EngineConfig.scheduling_policy): fcfs refuses a priority


BackendFactory = Callable[[], "ServingState | tuple"]


def grpc_options(port: int = 9000, request_timeout_s: float | None = None) -> gRPCOptions:
    """Serve gRPC proxy options that register `pdserve.Generation`; pass to `serve.start(grpc_options=...)`."""
    return gRPCOptions(port=port, grpc_servicer_functions=[SERVICER_FUNCTION], request_timeout_s=request_timeout_s)


def local_engine_factory(model_name: str = "pdserve", max_num_requests: int | None = None,
                         **engine_overrides: Any) -> BackendFactory:
    """A factory for one in-replica `LLMEngine` behind a `LocalEngineBackend` ("colocated" mode).

    `engine_overrides` are `EngineConfig` fields (model=None: the embedded SmolLM2). The factory is a
    picklable partial of a module-level function, so `GRPCIngress.bind(factory)` ships it to replicas.
    """
    return functools.partial(_build_local_backend, model_name, max_num_requests, dict(engine_overrides))


def _build_local_backend(model_name: str, max_num_requests: int | None, engine_overrides: dict) -> ServingState:
    from engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(**engine_overrides))
    backend = LocalEngineBackend(engine, max_num_requests=max_num_requests)
    return ServingState(backend, engine.tokenizer, model_name, engine.max_model_len, engine.vocab_size,
                        engine.config.scheduling_policy)


# ---------------------------------------------------------------------- errors
class GRPCError(Exception):
    """Ends the call with `code`; `message` starts with the offending field for caller errors."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message

    def __reduce__(self):  # crosses the replica → proxy boundary inside Serve's error wrapper
        return GRPCError, (self.code, self.message)

    @classmethod
    def of(cls, e: Exception) -> GRPCError:
        """The status for one of the neutral errors: preparation, backend refusal, backend failure."""
        if isinstance(e, UnknownModelError):
            return cls(grpc.StatusCode.NOT_FOUND, str(e))
        if isinstance(e, InvalidRequestError):
            return cls(grpc.StatusCode.INVALID_ARGUMENT, f"{e.field}: {e.message}")
        if isinstance(e, QueueFullError):
            return cls(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{e}; retry after {max(1, math.ceil(e.retry_after_s))}s")
        if isinstance(e, GenerationFailed):
            # NOTE: the backend's reason may hold internal text: it is logged (text_stream.py), not sent.
            return cls(grpc.StatusCode.INTERNAL, f"generation failed for request {e.request_id}; "
                                                 "the server log has the cause")
        raise TypeError(f"not a neutral error: {type(e).__name__}")


_NEUTRAL_ERRORS = (InvalidRequestError, QueueFullError, GenerationFailed)
UNAUTHENTICATED = GRPCError(grpc.StatusCode.UNAUTHENTICATED,
                            "missing or invalid API key: send metadata `authorization: Bearer <key>`")


# ---------------------------------------------------------------------- request → neutral inputs
def _refuse_unknown_fields(req: pdserve_pb2.GenerateRequest) -> None:
    """Fields of a newer .proto than this server's are refused, never ignored (as at the HTTP door)."""
    subs = [("structured_output", req.structured_output)] if req.HasField("structured_output") else []
    for field_name, msg in [("request", req), *(("messages", m) for m in req.messages), *subs]:
        numbers = sorted({f.field_number for f in unknown_fields.UnknownFieldSet(msg)})
        if numbers:
            raise InvalidRequestError(field_name, f"fields {numbers[:8]} are unknown to this server")


def _prompt_input(req: pdserve_pb2.GenerateRequest) -> PromptInput:
    """The one prompt form that is set; the field that holds it is the one errors name."""
    forms = [name for name, given in (("prompt", bool(req.prompt)), ("prompt_token_ids", len(req.prompt_token_ids) > 0),
                                      ("messages", len(req.messages) > 0)) if given]
    if len(forms) != 1:
        got = " and ".join(forms) if forms else "none"
        raise InvalidRequestError("prompt", f"set exactly one of prompt, prompt_token_ids, messages (got {got})")
    if forms[0] == "prompt":
        return PromptInput(PromptKind.TEXT, req.prompt, "prompt")
    if forms[0] == "prompt_token_ids":
        return PromptInput(PromptKind.TOKEN_IDS, list(req.prompt_token_ids), "prompt_token_ids")
    return PromptInput(PromptKind.CHAT, [{"role": m.role, "content": m.content} for m in req.messages], "messages")


def _optional(req: pdserve_pb2.GenerateRequest, name: str) -> Any:
    return getattr(req, name) if req.HasField(name) else None  # proto3 `optional`: unset is None, not 0


def _sampling_input(req: pdserve_pb2.GenerateRequest) -> SamplingInput:
    return SamplingInput(max_tokens=_optional(req, "max_tokens"), temperature=_optional(req, "temperature"),
                         top_p=_optional(req, "top_p"), top_k=_optional(req, "top_k"), seed=_optional(req, "seed"),
                         stop=list(req.stop), stop_token_ids=list(req.stop_token_ids), ignore_eos=req.ignore_eos,
                         min_tokens=_optional(req, "min_tokens"), presence_penalty=_optional(req, "presence_penalty"),
                         speculative=_optional(req, "speculative") is not False,  # unset: the server's method
                         frequency_penalty=_optional(req, "frequency_penalty"),
                         repetition_penalty=_optional(req, "repetition_penalty"), min_p=_optional(req, "min_p"),
                         logit_bias=dict(req.logit_bias) or None, logprobs=_optional(req, "logprobs"),
                         prompt_logprobs=_optional(req, "prompt_logprobs"), structured=_structured(req))


def _structured(req: pdserve_pb2.GenerateRequest) -> StructuredSpec | None:
    """The `structured_output` spec, checked (structured_request.py); None when unset."""
    if not req.HasField("structured_output"):
        return None
    return spec_from_grpc(req.structured_output.kind, req.structured_output.value)


def num_samples(req: pdserve_pb2.GenerateRequest) -> int:
    """`n`, checked: 1 when unset."""
    n = _optional(req, "n")
    if n is not None and not 1 <= n <= MAX_N:
        raise GRPCError(grpc.StatusCode.INVALID_ARGUMENT, f"n: must be an integer in [1, {MAX_N}]")
    return 1 if n is None else n


async def prepare_request(req: pdserve_pb2.GenerateRequest, model: ServedModel) -> PreparedRequest:
    """Validate `req` and turn it into what the backend takes (prepare.py); raises `GRPCError`."""
    try:
        _refuse_unknown_fields(req)
        model.check_name(req.model or None)  # empty: the served model
        return await prepare_off_loop(model, _prompt_input(req), _sampling_input(req), req.priority,
                                      _optional(req, "cache_salt"))
    except InvalidRequestError as e:
        raise GRPCError.of(e) from None


def _proto_logprobs(texts: TokenText, token_ids: list[int], logprobs: list) -> list[pdserve_pb2.TokenLogprob]:
    """Engine TokenLogprobs (None: the prompt's first token) as protobuf messages."""
    out = []
    for token_id, lp in zip(token_ids, logprobs):
        msg = pdserve_pb2.TokenLogprob(token_id=token_id, token=texts.text(token_id))
        if lp is not None:
            msg.logprob = clamp(lp.logprob)
            msg.top.extend(pdserve_pb2.TopLogprob(token_id=t, logprob=clamp(v), token=texts.text(t)) for t, v in lp.top)
        out.append(msg)
    return out


# ---------------------------------------------------------------------- the stream
async def generate_stream(backend: GenerateBackend, model: ServedModel, request_id: str,
                          prepared: PreparedRequest, n: int = 1,
                          on_close: Callable[[], None] | None = None) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
    """The text streams of the `n` samples as response chunks (each with its sample's `index`); each
    sample's last chunk carries its finish_reason, the call's last chunk also the usage.

    `token_ids` are what the model generated; `text` is cut at the first stop string (the tokens that
    spelled it may still appear in `token_ids`). Raises `GRPCError` for refusals and failures.
    """
    stream = FanOut(backend, request_id, [prepared], n, model.tokenizer, on_close=on_close)
    texts = TokenText(model.tokenizer)
    started: set[int] = set()
    left = n
    try:
        try:
            await stream.start()
            async for chunk in stream.chunks():
                out = pdserve_pb2.GenerateResponse(request_id=request_id, text=chunk.text, token_ids=chunk.token_ids,
                                                   finish_reason=chunk.finish_reason or "", index=chunk.index)
                if chunk.logprobs is not None:
                    out.logprobs.extend(_proto_logprobs(texts, chunk.token_ids, chunk.logprobs))
                prompt_lps = stream.prompt_logprobs(chunk.index)
                if chunk.index not in started and prompt_lps is not None:
                    out.prompt_logprobs.extend(_proto_logprobs(texts, prepared.prompt_token_ids, prompt_lps))
                started.add(chunk.index)
                left -= bool(chunk.finish_reason)
                if not left:
                    _set_usage(out, stream.usage)
                yield out
        except _NEUTRAL_ERRORS as e:
            raise GRPCError.of(e) from None
    finally:
        # NOTE: a client that goes away cancels this generator: the request must not keep running.
        await stream.close()


def _set_usage(out: pdserve_pb2.GenerateResponse, usage: Usage) -> None:
    out.usage.prompt_tokens = usage.num_prompt_tokens
    out.usage.completion_tokens = usage.num_completion_tokens
    out.usage.total_tokens = usage.num_prompt_tokens + usage.num_completion_tokens
    out.usage.cached_tokens = usage.num_cached_tokens


# ---------------------------------------------------------------------- the service
def _fail(grpc_context: RayServegRPCContext, e: GRPCError) -> GRPCError:
    # Serve keeps a code set on the context when the method raises (gRPCStatusError).
    grpc_context.set_code(e.code)
    grpc_context.set_details(e.message)
    return e


def _begin_trace(grpc_context: RayServegRPCContext, request_id: str) -> tracing.RequestTrace | None:
    """The call's root span when tracing is on (deployments/tracing.py), as the HTTP door's: a child of
    the client's W3C `traceparent` (and `tracestate`) metadata when it sent them."""
    if not tracing.enabled():
        return None
    metadata = {k.lower(): v for k, v in grpc_context.invocation_metadata() if isinstance(v, str)}
    return tracing.begin_request("request", metadata, time.time_ns(), {
        "rpc.system": "grpc", "rpc.method": "pdserve.Generation/Generate", "stream": True, "request_id": request_id})


class GenerationService:
    """`pdserve.Generation`, one method per RPC (named as in the .proto), without Serve: what the
    deployment below runs, and what tests drive in process with a stand-in context.

    api_key: when set, both RPCs need metadata `authorization: Bearer <api_key>` (as HTTP's /v1);
    Health answers without it too, but with its status only (as HTTP's /health).
    tenants / max_request_tokens: as the HTTP app's (frontend/tenants.py): a tenant's key works here too,
    with the same share of this replica.
    """

    def __init__(self, state: ServingState, api_key: str | None = None, tenants: TenantBook | None = None,
                 max_request_tokens: int | None = None):
        self.backend = state.backend
        self.model = ServedModel.of(state.model_name, state.tokenizer, state.max_model_len, state.vocab_size,
                                    state.scheduling_policy)
        self.api_key = api_key
        self.tenants = tenants
        self.max_request_tokens = max_request_tokens

    def _caller(self, grpc_context: RayServegRPCContext) -> tuple[bool, Tenant | None]:
        """(whether the call may go on, its tenant) from its `authorization` metadata."""
        header = next((v for k, v in grpc_context.invocation_metadata() if k == "authorization"), None)
        header = header if isinstance(header, str) else None
        tenant = self.tenants.identify(header) if self.tenants is not None else None
        if tenant is not None:
            return True, tenant
        if self.tenants is not None and not self.api_key:
            return False, None
        return bearer_matches(header, self.api_key), None

    def _authorized(self, grpc_context: RayServegRPCContext) -> bool:
        return self._caller(grpc_context)[0]

    async def Generate(self, request: pdserve_pb2.GenerateRequest,
                       grpc_context: RayServegRPCContext) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
        request_id = f"grpc-{uuid.uuid4().hex}"
        rt = _begin_trace(grpc_context, request_id)  # None: tracing off
        try:
            ok, tenant = self._caller(grpc_context)
            if not ok:
                raise UNAUTHENTICATED
            n = num_samples(request)
            t_prepare = time.time_ns()
            prepared = await prepare_request(request, self.model)
            if rt is not None:
                tracing.record("door.prepare", rt.span, t_prepare, attributes={
                    "prompts": 1, "prompt_tokens": len(prepared.prompt_token_ids), "n": n,
                    "structured_output": prepared.params.structured is not None})
            try:
                (prepared,), admission = admit_call(self.tenants, tenant, [prepared], n, self.max_request_tokens)
            except APIError as e:
                code = grpc.StatusCode.RESOURCE_EXHAUSTED if e.status_code == 429 else grpc.StatusCode.INVALID_ARGUMENT
                raise GRPCError(code, f"{e.param}: {e.message}" if e.param else e.message) from None
            async for out in generate_stream(self.backend, self.model, request_id, prepared, n, admission.release):
                yield out
        except GRPCError as e:
            tracing.end_request(rt, e.code.name)
            raise _fail(grpc_context, e)
        except Exception as e:  # noqa: BLE001 - a bug: the log gets the text, the client a generic status
            tracing.end_request(rt, type(e).__name__)
            logger.error("gRPC request %s failed", request_id, exc_info=e)
            raise _fail(grpc_context, GRPCError(grpc.StatusCode.INTERNAL, f"internal error in request {request_id}; "
                                                                          "the server log has the cause")) from None

    async def Health(self, request: pdserve_pb2.HealthRequest,
                     grpc_context: RayServegRPCContext) -> pdserve_pb2.HealthResponse:
        try:
            info = await self.backend.health()
        except Exception as e:  # noqa: BLE001 - the answer is "unhealthy", whatever broke
            info = {"status": "unhealthy", "error": f"{type(e).__name__}: {e}"}
        status = str(info.get("status", "ok"))
        if not self._authorized(grpc_context):
            return pdserve_pb2.HealthResponse(status=status)
        return pdserve_pb2.HealthResponse(status=status, model=self.model.name,
                                          details_json=json.dumps(info, default=str))


@serve.deployment(max_ongoing_requests=256)
class GRPCIngress(GenerationService):
    """Serve deployment for `pdserve.Generation` (the methods are GenerationService's).

    backend_factory: called once per replica; returns `ServingState(backend, tokenizer, model_name,
    max_model_len[, vocab_size])` or the same tuple. Use `local_engine_factory(...)` for an in-replica
    engine, or a factory that builds the router backend (deployments/app.py).
    api_key: as GenerationService's (the server's `--api-key`).
    NOTE: max_ongoing_requests bounds concurrent streams per replica; the backend's own queue limit
    (QueueFullError → RESOURCE_EXHAUSTED) is the real admission control.
    """

    def __init__(self, backend_factory: BackendFactory, api_key: str | None = None,
                 tenants_file: str | None = None, max_request_tokens: int | None = None):
        tenants = TenantBook.from_file(tenants_file) if tenants_file else None
        super().__init__(ServingState(*backend_factory()), api_key, tenants, max_request_tokens)
