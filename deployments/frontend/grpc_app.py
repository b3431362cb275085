"""The generate call as a server-streaming gRPC service (`pdserve.Generation`) behind Serve's gRPC proxy.

```
grpc client ──/pdserve.Generation/Generate──▶ Serve gRPC proxy ──(metadata `application`)──▶
    GRPCIngress.Generate(request, grpc_context) ──▶ GenerateBackend.generate ──▶ TokenDeltas
        ──▶ IncrementalDetokenizer ──▶ StopStringFilter ──▶ stream of GenerateResponse chunks
```

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
"""

from __future__ import annotations

import functools
import json
import logging
import math
import uuid
from typing import Any, AsyncIterator, Callable, NamedTuple

import grpc
from ray import serve
from ray.serve.config import gRPCOptions
from ray.serve.grpc_util import RayServegRPCContext

from deployments.frontend.backend import GenerateBackend, LocalEngineBackend, QueueFullError, TokenDelta
from deployments.frontend.grpc import pdserve_pb2
from deployments.frontend.http_app import IncrementalDetokenizer, StopStringFilter
from engine import InvalidRequestError, SamplingParams

logger = logging.getLogger(__name__)

# The import path Serve's proxy loads to register the service.
SERVICER_FUNCTION = "deployments.frontend.grpc.pdserve_pb2_grpc.add_GenerationServicer_to_server"
DEFAULT_APP_NAME = "pdserve-grpc"
# As /v1/completions: 16 for prompt / prompt_token_ids; chat (messages) gets the rest of the context.
DEFAULT_MAX_TOKENS = 16


class ServingState(NamedTuple):
    """What a backend factory returns (a plain 4-tuple in this order works too)."""

    backend: GenerateBackend
    tokenizer: Any  # a transformers tokenizer: encode, decode, apply_chat_template, len()
    model_name: str
    max_model_len: int


BackendFactory = Callable[[], "ServingState | tuple[GenerateBackend, Any, str, int]"]


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
    return ServingState(backend, engine.tokenizer, model_name, engine.max_model_len)


# ---------------------------------------------------------------------- request → prompt ids + params
class GRPCError(Exception):
    """Ends the call with `code`; `message` starts with the offending field for caller errors."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message

    def __reduce__(self):  # crosses the replica → proxy boundary inside Serve's error wrapper
        return GRPCError, (self.code, self.message)

    @classmethod
    def invalid(cls, field: str, message: str) -> GRPCError:
        return cls(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {message}")


def prepare_request(req: pdserve_pb2.GenerateRequest, state: ServingState) -> tuple[list[int], SamplingParams]:
    """Validate `req` and turn it into prompt token ids and sampling params; raises `GRPCError`."""
    if req.model and req.model != state.model_name:
        raise GRPCError(grpc.StatusCode.NOT_FOUND,
                        f"model: `{req.model}` does not exist; this server serves `{state.model_name}`")
    forms = [name for name, given in (("prompt", bool(req.prompt)), ("prompt_token_ids", len(req.prompt_token_ids) > 0),
                                      ("messages", len(req.messages) > 0)) if given]
    if len(forms) != 1:
        got = " and ".join(forms) if forms else "none"
        raise GRPCError.invalid("prompt", f"set exactly one of prompt, prompt_token_ids, messages (got {got})")
    form = forms[0]
    tokenizer = state.tokenizer
    if form == "prompt":
        prompt_ids = list(tokenizer.encode(req.prompt, add_special_tokens=False))
    elif form == "prompt_token_ids":
        vocab_size = len(tokenizer)
        prompt_ids = list(req.prompt_token_ids)
        if any(t < 0 or t >= vocab_size for t in prompt_ids):
            raise GRPCError.invalid(form, f"token ids must be in [0, {vocab_size})")
    else:
        messages = [{"role": m.role, "content": m.content} for m in req.messages]
        try:
            out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as e:  # jinja's raise_exception (roles must alternate, ...), no template
            raise GRPCError.invalid(form, f"the chat template rejected them: {e}") from None
        prompt_ids = list(out if isinstance(out, list) else out["input_ids"])
    if not prompt_ids:
        raise GRPCError.invalid(form, "encodes to no tokens")
    remaining = state.max_model_len - len(prompt_ids)
    if remaining < 1:
        raise GRPCError.invalid(form, f"{len(prompt_ids)} tokens, but this model's maximum context length is "
                                      f"{state.max_model_len} tokens including at least one generated token")
    if req.HasField("max_tokens"):
        max_tokens = req.max_tokens
        if max_tokens > remaining:
            raise GRPCError.invalid("max_tokens", f"{max_tokens} is too large: the context holds "
                                                  f"{state.max_model_len} tokens and the prompt has {len(prompt_ids)}, "
                                                  f"so at most {remaining} can be generated")
    else:
        max_tokens = remaining if form == "messages" else min(DEFAULT_MAX_TOKENS, remaining)
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=req.temperature if req.HasField("temperature") else 1.0,
            top_p=req.top_p if req.HasField("top_p") else 1.0,
            top_k=req.top_k if req.HasField("top_k") else -1,
            seed=req.seed if req.HasField("seed") else None,
            stop=list(req.stop),
            stop_token_ids=list(req.stop_token_ids),
            ignore_eos=req.ignore_eos,
            min_tokens=req.min_tokens if req.HasField("min_tokens") else 0,
        )
    except InvalidRequestError as e:
        raise GRPCError.invalid(e.field, e.message) from None
    return prompt_ids, params


# ---------------------------------------------------------------------- the stream
async def generate_stream(state: ServingState, request_id: str, prompt_ids: list[int], params: SamplingParams,
                          priority: int = 0) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
    """Backend deltas as response chunks; the last one carries finish_reason and usage.

    `token_ids` are what the model generated; `text` is cut at the first stop string (the tokens that
    spelled it may still appear in `token_ids`). Raises `GRPCError` for refusals and failures.
    """
    backend = state.backend
    gen = backend.generate(request_id, prompt_ids, params, priority)
    detok = IncrementalDetokenizer(state.tokenizer)
    stops = StopStringFilter(params.stop)
    num_generated = 0
    num_cached = 0  # the first event's: what the (first) prefill found in the prefix cache
    done = False  # the backend has nothing more for this request

    def chunk(text: str, token_ids: list[int], finish_reason: str = "") -> pdserve_pb2.GenerateResponse:
        out = pdserve_pb2.GenerateResponse(request_id=request_id, text=text, token_ids=token_ids,
                                           finish_reason=finish_reason)
        if finish_reason:
            out.usage.prompt_tokens = len(prompt_ids)
            out.usage.completion_tokens = num_generated
            out.usage.total_tokens = len(prompt_ids) + num_generated
            out.usage.cached_tokens = num_cached
        return out

    try:
        try:
            first = await gen.__anext__()
        except QueueFullError as e:
            done = True
            raise GRPCError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"{e}; retry after {max(1, math.ceil(e.retry_after_s))}s") from None
        except InvalidRequestError as e:
            done = True
            raise GRPCError.invalid(e.field, e.message) from None
        except StopAsyncIteration:
            done = True
            raise GRPCError(grpc.StatusCode.INTERNAL, "the backend ended the request without output") from None
        delta: TokenDelta = first
        num_cached = first.num_cached_tokens
        while True:
            num_generated += len(delta.token_ids)
            text = detok.push(delta.token_ids)
            if delta.finished:
                done = True
                text += detok.flush()
            out, hit_stop = stops.feed(text)
            if hit_stop:
                if not done:
                    done = True
                    await backend.abort(request_id)
                yield chunk(out, delta.token_ids, "stop")
                return
            if delta.finished:
                out += stops.flush()
                if delta.finish_reason == "error":
                    if out or delta.token_ids:
                        yield chunk(out, delta.token_ids)
                    raise GRPCError(grpc.StatusCode.INTERNAL, f"generation failed: {delta.error}")
                yield chunk(out, delta.token_ids, delta.finish_reason or "stop")
                return
            if out or delta.token_ids:
                yield chunk(out, delta.token_ids)
            try:
                delta = await gen.__anext__()
            except StopAsyncIteration:
                done = True
                raise GRPCError(grpc.StatusCode.INTERNAL,
                                "the backend stream ended before the request finished") from None
    finally:
        # NOTE: a client that goes away cancels this generator: the request must not keep running.
        if not done:
            await backend.abort(request_id)
        await gen.aclose()


# ---------------------------------------------------------------------- the Serve deployment
@serve.deployment(max_ongoing_requests=256)
class GRPCIngress:
    """Serve deployment for `pdserve.Generation`; one method per RPC, named as in the .proto.

    backend_factory: called once per replica; returns `ServingState(backend, tokenizer, model_name,
    max_model_len)` or the same 4-tuple. Use `local_engine_factory(...)` for an in-replica engine, or
    a factory that builds the router backend.
    NOTE: max_ongoing_requests bounds concurrent streams per replica; the backend's own queue limit
    (QueueFullError → RESOURCE_EXHAUSTED) is the real admission control.
    """

    def __init__(self, backend_factory: BackendFactory):
        self.state = ServingState(*backend_factory())

    async def Generate(self, request: pdserve_pb2.GenerateRequest,
                       grpc_context: RayServegRPCContext) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
        request_id = f"grpc-{uuid.uuid4().hex}"
        try:
            prompt_ids, params = prepare_request(request, self.state)
            async for out in generate_stream(self.state, request_id, prompt_ids, params, request.priority):
                yield out
        except GRPCError as e:
            # Serve keeps a code set on the context when the method raises (gRPCStatusError).
            grpc_context.set_code(e.code)
            grpc_context.set_details(e.message)
            raise

    async def Health(self, request: pdserve_pb2.HealthRequest,
                     grpc_context: RayServegRPCContext) -> pdserve_pb2.HealthResponse:
        try:
            info = await self.state.backend.health()
        except Exception as e:
            info = {"status": "unhealthy", "error": f"{type(e).__name__}: {e}"}
        return pdserve_pb2.HealthResponse(status=str(info.get("status", "ok")), model=self.state.model_name,
                                          details_json=json.dumps(info, default=str))
