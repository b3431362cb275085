"""What crosses process boundaries between ingress, router and workers (plain slots dataclasses)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine import SamplingParams


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
    hub: object  # ActorHandle of the ingress replica's StreamHub
    priority: int = 0
    offset: int = 0
    num_original_prompt_tokens: int = 0
    arrival_time: float = 0.0
    attempt: int = 0


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


@dataclass(slots=True)
class DecodeReport:
    """A decode worker's report after every step: what the router needs for admission."""

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
