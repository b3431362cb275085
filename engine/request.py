"""A request's state inside one engine (vLLM v1 style: computed tokens catch up with all tokens)."""

from __future__ import annotations

import array
import enum
import hashlib
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from engine.block_manager import BlockKey
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from engine.structured import GrammarState


class TokenLogprob(NamedTuple):
    """One token's raw logprob and the top alternatives at its position (best first, ties by id)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token_id, logprob), k = the request's logprobs / prompt_logprobs


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    # Prefill finished in a prefill-only engine: KV blocks are held for export until released.
    PREFILLED = "prefilled"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    # Something this request carried made its own work fail (e.g. its sampling); it alone ends.
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
            RequestStatus.FINISHED_ERROR,
            RequestStatus.PREFILLED,
        )


_arrival_counter = itertools.count()


def cache_root(cache_salt: str | None) -> bytes:
    """The key a request's first block chains to: requests share prefix-cache entries only when they
    share the salt (none is a salt of its own)."""
    return b"" if cache_salt is None else hashlib.sha256(b"pdserve-cache-salt\0" + cache_salt.encode()).digest()


def extend_block_keys(keys: list[BlockKey], token_ids: list[int], num_blocks: int, block_size: int,
                      cache_salt: str | None = None) -> list[BlockKey]:
    """Append the prefix-cache keys of `token_ids`' full blocks len(keys)..num_blocks-1 to `keys`: each
    is SHA-256 of the key before it (the salt's root for the first) and the block's tokens, so a block
    only matches after the same prefix under the same salt."""
    for i in range(len(keys), num_blocks):
        parent = keys[-1] if keys else cache_root(cache_salt)
        tokens = array.array("q", token_ids[i * block_size:(i + 1) * block_size]).tobytes()
        keys.append(hashlib.sha256(parent + tokens).digest())
    return keys


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0  # lower runs first
    prefill_only: bool = False
    # The recompute of a stream whose client is stalled mid-stream (its worker died): a step that
    # admits it admits no other new prompt after it, and no per-step prefill cap holds it back.
    urgent: bool = False
    arrival_time: float = field(default_factory=time.monotonic)
    arrival_seq: int = field(default_factory=lambda: next(_arrival_counter))
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    # KV bookkeeping, owned by the scheduler.
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    # Text bookkeeping for stop strings, owned by the engine.
    output_text: str = ""
    stop_reason: str | int | None = None
    # Incremental detokenization: output_token_ids[detok_prefix:detok_read] decode to the text just
    # before the newest tokens (context for tokenizers whose pieces depend on what precedes them).
    detok_prefix: int = 0
    detok_read: int = 0
    generator: torch.Generator | None = None  # engine.sampler's (the reference's) draws
    # The key of engine.device_sampler's draws, with each token's position: the request's seed, or one
    # the engine picks (None: greedy, or a request no engine has seen: the sampler picks one on use).
    sample_seed: int | None = None
    first_token_time: float | None = None
    # Prefix cache, owned by the scheduler: keys of the full blocks so far, how many of this request's
    # blocks are registered in the cache, and how many prompt tokens the last admission found cached.
    block_keys: list[BlockKey] = field(default_factory=list)
    cache_salt: str | None = None
    num_registered_blocks: int = 0
    num_cached_tokens: int = 0
    # Speculation, set by the engine before each step (engine.spec.Speculator): guessed next tokens
    # for the scheduler to verify this step. [] outside a step that drafts for it.
    spec_token_ids: list[int] = field(default_factory=list)
    # Structured output: the request's grammar matcher (engine.structured), None when unconstrained.
    grammar: GrammarState | None = None
    # prompt_logprobs, filled position by position as the prompt is computed ([0] is None); handed out
    # once, with the first output (`prompt_logprobs_sent`), then never computed again (recomputes skip it).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs_sent: bool = False
    # A resumed stream (its worker died, or it moved): the last `num_resumed_output` prompt tokens are
    # this request's own earlier output. Its grammar continues after them and the output penalties
    # (frequency, presence) count them, so a move changes nothing the client can see.
    num_resumed_output: int = 0
    # Fair shares: the tenant (API key) that sent it and that tenant's weight. With tenants set the
    # scheduler orders waiting requests by each tenant's weighted use and preempts from the heaviest
    # tenant (engine/fair_share.py); None: one tenant, plain (priority, arrival) order.
    tenant: str | None = None
    tenant_weight: float = 1.0
    fair_start: float | None = None  # its weighted-fair-queueing tags, set when first queued
    fair_finish: float | None = None

    @property
    def token_cost(self) -> int:
        """What it asks of the KV cache at most: its prompt and all the output it may still add."""
        return len(self.prompt_token_ids) + max(0, self.params.max_tokens - len(self.output_token_ids))

    def full_block_keys(self, num_blocks: int, block_size: int) -> list[BlockKey]:
        """The prefix-cache keys of this request's first `num_blocks` full blocks (computed once)."""
        if len(self.block_keys) < num_blocks:
            extend_block_keys(self.block_keys, self.all_token_ids, num_blocks, block_size, self.cache_salt)
        return self.block_keys[:num_blocks]

    @property
    def grammar_terminated(self) -> bool:
        """A structured request's grammar accepted its stop token: the request is done ("stop")."""
        return self.grammar is not None and self.grammar.terminated

    @property
    def original_prompt_ids(self) -> list[int]:
        """The client's prompt: the prompt without the resumed output."""
        return self.prompt_token_ids[:len(self.prompt_token_ids) - self.num_resumed_output]

    @property
    def generated_ids(self) -> list[int]:
        """Everything this request generated, before a resume (in the prompt) and after it."""
        k = self.num_resumed_output
        return (self.prompt_token_ids[-k:] if k else []) + self.output_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def sort_key(self) -> tuple[int, float, int]:
        return (self.priority, self.arrival_time, self.arrival_seq)


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request.

    new_token_ids: tokens sampled this step (several when drafts were accepted: speculative decoding).
    token_ids / text: the whole generated part so far (EOS and stop tokens excluded; text cut at a
    stop string).
    """

    request_id: str
    new_token_ids: list[int]
    token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    text: str = ""
    num_prompt_tokens: int = 0
    # Prompt tokens whose KV came from the prefix cache instead of being computed.
    num_cached_tokens: int = 0
    # Set for prefill-only requests once prefill is done: the blocks that hold the prompt's KV.
    block_ids: list[int] | None = None
    # finish_reason "error": what failed, naming the request's parameter where one is to blame.
    error: str | None = None
    # With params.logprobs: one per token of new_token_ids (this output's tokens only).
    logprobs: list[TokenLogprob] | None = None
    # With params.prompt_logprobs, on the request's first output only: one per prompt token, [0] None.
    prompt_logprobs: list[TokenLogprob | None] | None = None
