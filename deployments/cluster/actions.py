"""What placement, pools and recovery ask the router actor to do: each action is one Ray call (or
one call and a task awaiting its answer), made by `Router._do` in the order given. The bookkeeping
that goes with it (reservations, stages, queue lengths) is already done when an action is returned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Union

from deployments.cluster.messages import GenRequest, StreamEvent
from deployments.cluster.state import Tracked, WorkerView


class BackupTarget(NamedTuple):
    """Where a decode worker copies a prompt it computes itself: prefill worker `worker_id`, from
    block `first_block` on (the blocks before it that worker caches already)."""

    worker_id: str
    first_block: int


class PrefixFetch(NamedTuple):
    """Where a decode worker pulls the cached first `num_tokens` of a prompt from before computing the
    rest: prefill worker `worker_id`."""

    worker_id: str
    num_tokens: int


@dataclass(frozen=True, slots=True)
class ToPrefill:
    """`PrefillWorker.add(tracked.req)` on `worker_id`."""

    tracked: Tracked
    worker_id: str


@dataclass(frozen=True, slots=True)
class RunWhole:
    """`DecodeWorker.resume` on `worker`: run the prompt whole there (colocated, a local prefill, a
    moved sequence). `need` blocks and `own` prompt tokens are reserved on it until it answers."""

    tracked: Tracked
    worker: WorkerView
    need: int
    own: int  # prompt tokens it computes itself (the rest is cached there, or fetched)
    fetch: PrefixFetch | None = None
    backup: BackupTarget | None = None


@dataclass(frozen=True, slots=True)
class AdmitKV:
    """`DecodeWorker.admit` on `worker`: pull the prefilled KV from `prefill_worker_id` and decode.
    `need` blocks are reserved on it until it answers."""

    tracked: Tracked
    worker: WorkerView
    prefill_worker_id: str
    need: int


@dataclass(frozen=True, slots=True)
class EndStream:
    """Push the last event of `req`'s stream to its client's hub (a failure, or its length reached)."""

    req: GenRequest
    event: StreamEvent


@dataclass(frozen=True, slots=True)
class ReleaseKV:
    """`kv_release` on prefill worker `worker_id`: the leased KV of `request_id` is not wanted."""

    worker_id: str
    request_id: str
    epoch: int


@dataclass(frozen=True, slots=True)
class AbortOn:
    """`abort(request_id, attempt)` on worker `worker_id`: only that attempt (None: any) ends there, so
    an abort meant for an attempt the router gave up on never ends the one that replaced it."""

    worker_id: str
    request_id: str
    attempt: int | None = None
    in_flight: bool = False  # its admit / resume may not have reached the worker yet


Action = Union[ToPrefill, RunWhole, AdmitKV, EndStream, ReleaseKV, AbortOn]
