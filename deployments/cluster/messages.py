"""What crosses process boundaries between ingress, router and workers: plain slots dataclasses,
NamedTuples and Enums, never dicts or tuples whose meaning is by position.

    ingress ──submit(GenRequest)──▶ router ──▶ SubmitResult
    ingress ──wait_ready()────────▶ router ──▶ ModelInfo
    router  ──info() / snapshot()──▶ worker ──▶ WorkerInfo / WorkerSnapshot
    router  ──admit() / resume()───▶ decode worker ──▶ Admission
    workers ──StreamEvent──▶ ingress's StreamHub;  decode worker ──DecodeReport──▶ router (on change)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from deployments.frontend.hub_wire import HubAddress
from engine import SamplingParams
from engine.request import TokenLogprob
from engine.spec.speculator import SpecStats

if TYPE_CHECKING:  # the door's process reads these messages without loading torch (kv_transfer does)
    from kv_transfer import KVHandle


class Role(str, enum.Enum):
    """A worker's pool. (A `str` so that it doubles as a metrics label and a JSON key via `.value`.)"""

    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(slots=True)
class GenRequest:
    """A request as the router and the workers see it.

    After a migration the router re-sends it with `prompt_token_ids` = original prompt + tokens already
    streamed, `params` shortened accordingly, and `offset` = how many tokens the client already has.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    hub_id: str
    hub: HubAddress  # where the ingress replica's StreamHub listens (frontend/hub_wire.py)
    priority: int = 0
    offset: int = 0
    num_original_prompt_tokens: int = 0
    arrival_time: float = 0.0
    attempt: int = 0
    # Prefix-cache entries (and cache-aware placement) are shared only among requests of the same salt.
    cache_salt: str | None = None
    # The door's trace context (W3C `traceparent` carrier, deployments/tracing.py); None: not traced.
    trace: dict[str, str] | None = None
    # The API key's tenant and its weight: the engines' fair queueing (engine/fair_share.py).
    tenant: str | None = None
    tenant_weight: float = 1.0

    @property
    def num_resumed_output(self) -> int:
        """How many tokens at the end of `prompt_token_ids` are this request's own earlier output (a
        resumed stream): the engine continues its grammar and output penalties after them."""
        if not self.offset or not self.num_original_prompt_tokens:
            return 0
        return max(0, len(self.prompt_token_ids) - self.num_original_prompt_tokens)


@dataclass(slots=True)
class StreamEvent:
    """Tokens for one request, pushed by whichever worker produced them.

    `offset` is the index (in the client's generated sequence) of token_ids[0]: the hub drops tokens it
    already delivered, so a migrated request never repeats a token.
    """

    request_id: str
    offset: int
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens the prefill found in the prefix cache (first event counts)
    # With params.logprobs: one engine TokenLogprob per token of token_ids (the prefill worker's event
    # carries the first token's).
    logprobs: list[TokenLogprob] | None = None
    # With params.prompt_logprobs: one per prompt token ([0] None), on the prefill's event only; never
    # on a migrated request's (offset > 0: the client has them).
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass(slots=True)
class DecodeReport:
    """A decode worker's report after a step that changed what the router needs for admission (a
    request finished, joined or started), else at most every `REPORT_EVERY_S` (decode_worker.py).
    `batch_size` and `num_preempted` cover every step since the previous report."""

    worker_id: str
    num_free_blocks: int
    num_total_blocks: int
    num_running: int
    num_waiting: int
    finished_ids: list[str] = field(default_factory=list)
    batch_size: int = 0
    step_s: float = 0.0
    num_preempted: int = 0
    prefill_backlog: int = 0  # prompt tokens still to compute here (local prefills, moved sequences)
    spec: SpecStats | None = None  # speculative decoding's counters since the worker started (for /health)
    num_steps: int = 0  # steps the worker has run
    # its reports' count (1, 2, ...): it covers every admission whose `Admission.report_seq` is below
    # it. Reports may arrive out of order: one older than the router's is not counted. 0: unnumbered
    # (covers every admission)
    seq: int = 0
    # its KV pairs (kv_transfer/pair_stats.py: `PairBook.snapshot()`), only when they changed since the
    # previous report; None: unchanged
    kv_pairs: dict[str, dict] | None = None


class SubmitResult(NamedTuple):
    """The router's answer to `submit`: accepted, or refused because its queue is full (the ingress
    answers 429 with `retry_after_s`)."""

    accepted: bool
    retry_after_s: float = 0.0
    reason: str = ""


class ModelInfo(NamedTuple):
    """What the ingress needs to know about the served model (`Router.wait_ready`)."""

    model_dir: str
    max_model_len: int
    vocab_size: int


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """A worker's answer to `info()`, once its model is loaded."""

    worker_id: str
    role: Role
    model: ModelInfo
    num_blocks: int
    block_size: int
    node_ip: str
    node_id: str
    device: str = ""  # its engine's device (cpu, cuda:0, ...)
    num_threads: int = 0  # its engine's CPU threads (0: not set, torch's default)


class LeasedKV(NamedTuple):
    """A prefilled request whose KV a prefill worker holds leased for a decode worker to pull."""

    req: GenRequest
    handle: KVHandle


@dataclass(slots=True)
class WorkerSnapshot:
    """What a worker holds, for a restarted router rebuilding its state (`Recovery.rebuild`)."""

    decoding: list[GenRequest] = field(default_factory=list)  # decode worker: its running requests
    prefilling: list[GenRequest] = field(default_factory=list)  # prefill worker: queued or running
    leased: list[LeasedKV] = field(default_factory=list)  # prefill worker: prefilled, KV not yet pulled


class Admission(NamedTuple):
    """A decode worker's answer to `admit` (pull prefilled KV) or `resume` (run a prompt whole):
    taken, or refused with the reason (a failed KV pull, or the engine refusing the request)."""

    accepted: bool
    reason: str = ""
    retry: bool = False  # refused for a reason of the moment (a failed KV pull): placing it again may work
    report_seq: int = 0  # taken: the worker's reports so far (`DecodeReport.seq`); later ones count it


class BackupTo(NamedTuple):
    """`DecodeWorker.resume`: once the prompt is computed, copy its full blocks from `first_block` on
    into this prefill worker's prefix cache (`PrefillWorker.kv_backup`)."""

    worker_id: str
    actor: Any
    first_block: int


class FetchFrom(NamedTuple):
    """`DecodeWorker.resume`: this prefill worker caches about the first `num_tokens` prompt tokens;
    pull them before computing the rest (`PrefillWorker.kv_lease_prefix`)."""

    worker_id: str
    actor: Any
    num_tokens: int
