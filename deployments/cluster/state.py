"""The router's bookkeeping as plain data: the requests it tracks, its picture of each worker, its
counters. The router actor owns one `RouterState`; placement, pools and recovery read and update it,
and none of them holds a Ray handle (the actor keeps those, by worker id).
"""

from __future__ import annotations

import enum
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field, replace
from typing import Hashable, NamedTuple

from deployments.cluster.messages import DecodeReport, GenRequest, Role, WorkerInfo
from deployments.cluster.prefix_index import PrefixIndex
from engine import SamplingParams
from kv_transfer import KVHandle


class Stage(enum.Enum):
    """Where a tracked request is. `worker_id` / `prefill_worker_id` of `Tracked` say on which worker."""

    UNPLACED = "unplaced"  # no prefill worker to take it yet: waits in `RouterState.unplaced`
    PREFILL = "prefill"  # queued or running on prefill worker `worker_id`
    PENDING_DECODE = "pending_decode"  # waits for a decode slot (KV leased on `prefill_worker_id`, or colocated)
    ADMITTING = "admitting"  # handed to decode worker `worker_id`, its answer not back yet
    DECODE = "decode"  # decoding on `worker_id`
    REQUEUEING = "requeueing"  # its worker died or its transfer failed: being placed again


def blocks_to_admit(num_tokens: int, block_size: int) -> int:
    """KV blocks to reserve for a sequence of `num_tokens` joining a decode worker: its tokens plus one
    block of growth, so that it does not preempt at once."""
    return -(-num_tokens // block_size) + 1


@dataclass(slots=True)
class Tracked:
    req: GenRequest
    params: SamplingParams  # as the client asked; a migrated request's req.params are shortened
    stage: Stage
    worker_id: str | None = None
    handle: KVHandle | None = None
    prefill_worker_id: str | None = None
    queued_tokens: int = 0  # what it added to its prefill worker's queue: its prompt less the cached part
    hashes: list[bytes] | None = None  # its prompt's block hashes (prefix-aware placement), computed once
    hashes_of: GenRequest | None = None  # ... for this req (a requeue replaces req and its prompt)
    adding: bool = False  # its prefill worker's `add` is sent and not yet answered


class Taken(NamedTuple):
    """An admission a decode worker took that its reports do not count yet (`WorkerView.taken`)."""

    report_seq: int  # the worker's reports when it took it: the ones numbered above count it
    blocks: int
    prefill_tokens: int


@dataclass(slots=True)
class WorkerView:
    """The router's picture of one worker (its Ray handle is the actor's, by `worker_id`)."""

    worker_id: str
    role: Role
    info: WorkerInfo | None = None  # once its model is loaded
    ready: bool = False
    draining: bool = False
    created_at: float = field(default_factory=time.time)
    ready_at: float | None = None
    queued_prompt_tokens: int = 0  # prefill
    report: DecodeReport | None = None  # decode: its last step report
    reserved_blocks: int = 0  # decode: blocks promised to admissions not yet in a report
    reserved_seqs: int = 0
    reserved_prefill_tokens: int = 0  # decode: prompt tokens handed over to run here, not yet reported
    taken: list[Taken] = field(default_factory=list)  # decode: admissions taken that no report counts yet
    max_batch_seen: int = 0
    num_steps: int = 0
    kv_pairs: dict[str, dict] = field(default_factory=dict)  # decode: its KV pairs, as last reported
    # Mixed (`--role-switching`, `switch_role(..., "mixed")`): a decode worker that also runs prompts of any
    # length whole, as a colocated one (`Placement._local_prefill`), not only the short ones.
    mixed: bool = False
    switching_to: Role | None = None  # changing role: takes no new work of `role`, then joins this pool
    switch_since: float | None = None  # when it began to

    @property
    def takes_work(self) -> bool:
        return self.ready and not self.leaving

    @property
    def leaving(self) -> bool:
        """Draining, or changing role: it takes no new work of its role and hands on what it can."""
        return self.draining or self.switching_to is not None

    def picture(self) -> DecodeReport:
        """Decode: its last report (or, before its first, since it started, its empty cache) with the
        admissions it took since (`taken`) counted on top: each a sequence, its blocks, its prompt to
        compute (the report's own, with no admission since)."""
        r = self.report
        if r is None:
            n = self.info.num_blocks if self.info is not None else 0
            r = DecodeReport(self.worker_id, n, n, num_running=0, num_waiting=0)
        if not self.taken:
            return r
        return replace(r, num_free_blocks=r.num_free_blocks - sum(t.blocks for t in self.taken),
                       num_running=r.num_running + len(self.taken),
                       prefill_backlog=r.prefill_backlog + sum(t.prefill_tokens for t in self.taken))

    def free_capacity(self, max_num_seqs: int) -> tuple[int, int]:
        """Decode: (free KV blocks, free sequence slots), less what admissions under way reserved."""
        r = self.picture()
        running = r.num_running + r.num_waiting
        return r.num_free_blocks - self.reserved_blocks, max_num_seqs - running - self.reserved_seqs

    def has_room(self, need_blocks: int, max_num_seqs: int) -> bool:
        """Decode: takes work and has a sequence slot and `need_blocks` free blocks."""
        free_blocks, free_seqs = self.free_capacity(max_num_seqs)
        return self.takes_work and free_seqs > 0 and free_blocks >= need_blocks

    def prefill_backlog(self) -> int:
        """Decode: prompt tokens it has yet to compute (local prefills, moved sequences)."""
        return self.picture().prefill_backlog + self.reserved_prefill_tokens

    def reserve(self, need_blocks: int, prefill_tokens: int = 0) -> None:
        self.reserved_blocks += need_blocks
        self.reserved_seqs += 1
        self.reserved_prefill_tokens += prefill_tokens

    def unreserve(self, need_blocks: int, taken: bool, prefill_tokens: int = 0, report_seq: int = 0) -> None:
        """The admission `reserve` was made for has its answer. If `taken`, it counts (`picture`) until
        a report that covers it arrives: one numbered above `report_seq`, the worker's count of reports
        when it took it. (Counted on the last report instead, it was lost to a report taken before the
        admission but delivered after its answer; before the worker's first report, to nothing, and a
        fresh worker was sent a whole burst whatever its `max_num_seqs`.)"""
        self.reserved_blocks -= need_blocks
        self.reserved_seqs -= 1
        self.reserved_prefill_tokens -= prefill_tokens
        if taken:
            # NOTE: an admission's first block is the prompt's last, partly filled one the worker adds to
            self.taken.append(Taken(report_seq, need_blocks - 1, prefill_tokens))

    def take_report(self, report: DecodeReport) -> None:
        """A decode report: its counts replace the last report's, and the admissions it covers are no
        longer counted on top; unless a newer report arrived first (then its counts are not used)."""
        if report.seq and self.report is not None and report.seq <= self.report.seq:
            return
        self.report = report
        # NOTE: an unnumbered report (seq 0: tests' hand-made ones) covers them all
        self.taken = [t for t in self.taken if report.seq and t.report_seq >= report.seq]


@dataclass(slots=True)
class Counters:
    """The router's event counts (`Router.stats()["counters"]`)."""

    submitted: int = 0
    rejected: int = 0
    finished: int = 0
    aborted: int = 0
    retries: int = 0  # re-prefilled: its prefill worker died or its KV transfer failed
    migrations: int = 0  # moved off a dead decode worker
    transfer_failures: int = 0
    admitted: int = 0
    worker_deaths: int = 0
    scale_ups: int = 0
    scale_downs: int = 0
    adopted_requests: int = 0
    failed: int = 0
    rebalanced: int = 0
    local_prefills: int = 0
    prefix_routed: int = 0
    prefix_routed_tokens: int = 0
    kv_backups: int = 0
    kv_backup_tokens: int = 0
    prefix_fetches: int = 0
    role_switches: int = 0  # begun (`--role-switching`)


class ExpiringSet:
    """Keys kept `ttl_s` seconds, at most `max_size` of them (the oldest go first): the marks of aborts
    heard before what they abort. The router's (`RouterState.early_aborts`): request ids whose abort
    arrived before their `submit` (Ray does not keep one caller's calls to an async actor in order);
    the submit is dropped (`Router.submit`). A worker's (`engine_worker.AbortMarks`): attempts aborted
    while the call bringing them was on its way. A mark nothing takes (any late abort of a request
    that ended leaves one; ids are unique per request) just expires."""

    def __init__(self, ttl_s: float, max_size: int = 65536):
        self.ttl_s, self.max_size = ttl_s, max_size
        self._keys: OrderedDict[Hashable, float] = OrderedDict()

    def add(self, key: Hashable) -> None:
        now = time.monotonic()
        self._keys[key] = now
        self._keys.move_to_end(key)
        while self._keys and (len(self._keys) > self.max_size or now - next(iter(self._keys.values())) >= self.ttl_s):
            self._keys.popitem(last=False)

    def take(self, key: Hashable) -> bool:
        """Whether `key` is here (and forget it)."""
        return self._keys.pop(key, None) is not None

    def __len__(self) -> int:
        return len(self._keys)


class MoveRecord(NamedTuple):
    """Where one sequence of a dead decode worker went (`Placement.place_moved`)."""

    time: float
    request_id: str
    to: str
    tokens: int  # its whole sequence
    recompute_tokens: int  # what its destination computes (the rest came from a prefix cache)
    tokens_ahead: int  # prompt tokens its destination computes before it
    fetch_from: str | None  # the prefill worker a decode destination pulls the cached prefix from


class Latencies:
    """What the router measured lately: each prefilled request's TTFT (arrival to prefilled KV) and each
    decode step's time, as (when, seconds); the role controller and the autoscaler judge their targets
    (`ttft_target_ms`, `tpot_target_ms`) on the p90 of a recent window."""

    def __init__(self, maxlen: int = 4096):
        self.ttft: deque[tuple[float, float]] = deque(maxlen=maxlen)
        self.steps: deque[tuple[float, float]] = deque(maxlen=maxlen)

    def record_ttft(self, seconds: float, now: float | None = None) -> None:
        self.ttft.append((time.time() if now is None else now, seconds))

    def record_step(self, seconds: float, now: float | None = None) -> None:
        self.steps.append((time.time() if now is None else now, seconds))

    @staticmethod
    def p90(samples: deque[tuple[float, float]], since: float) -> float | None:
        values = sorted(v for t, v in samples if t >= since)
        if not values:
            return None
        return values[min(len(values) - 1, int(0.9 * len(values)))]


@dataclass
class RouterState:
    prefix_index: PrefixIndex
    pools: dict[Role, dict[str, WorkerView]] = field(default_factory=lambda: {r: {} for r in Role})
    tracked: dict[str, Tracked] = field(default_factory=dict)
    pending_decode: list[str] = field(default_factory=list)  # request ids waiting for a decode slot
    unplaced: list[str] = field(default_factory=list)  # request ids waiting for a prefill worker
    early_aborts: ExpiringSet = field(default_factory=lambda: ExpiringSet(ttl_s=60.0))  # request ids
    counters: Counters = field(default_factory=Counters)
    moves: deque[MoveRecord] = field(default_factory=lambda: deque(maxlen=100))
    latencies: Latencies = field(default_factory=Latencies)

    @property
    def prefill(self) -> dict[str, WorkerView]:
        return self.pools[Role.PREFILL]

    @property
    def decode(self) -> dict[str, WorkerView]:
        return self.pools[Role.DECODE]

    def workers(self) -> list[WorkerView]:
        return [w for pool in self.pools.values() for w in pool.values()]

    def worker(self, worker_id: str | None) -> WorkerView | None:
        """The live worker `worker_id`, in whichever pool (a worker that changed role may still hold
        work of its old one: prompts' KV leased out, sequences finishing)."""
        for pool in self.pools.values():
            if (w := pool.get(worker_id or "")) is not None:
                return w
        return None

    def num_queued(self) -> int:
        """Requests accepted but not yet decoding (what `max_queued_requests` limits)."""
        return sum(1 for t in self.tracked.values() if t.stage is not Stage.DECODE)

    def num_waiting_prefill(self) -> int:
        return sum(1 for t in self.tracked.values() if t.stage in (Stage.UNPLACED, Stage.PREFILL))

    def load(self, w: WorkerView) -> int:
        """Tracked requests on `w` (either role): a draining worker closes once this is 0."""
        return sum(1 for t in self.tracked.values() if w.worker_id in (t.worker_id, t.prefill_worker_id))

    def max_model_len(self) -> int:
        for w in self.workers():
            if w.info is not None:
                return w.info.model.max_model_len
        return 1 << 30

    def remove_worker(self, w: WorkerView) -> bool:
        """Drop `w` from its pool and the prefix index; False if it was gone already."""
        if self.pools[w.role].pop(w.worker_id, None) is None:
            return False
        self.prefix_index.remove_worker(w.worker_id)
        return True

    def finish(self, worker_id: str, request_id: str) -> Tracked | None:
        """`worker_id` says `request_id` ended there; the tracked entry, if it was still its."""
        t = self.tracked.get(request_id)
        if t is None or t.worker_id != worker_id:
            return None
        del self.tracked[request_id]
        self.counters.finished += 1
        return t
