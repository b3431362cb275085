"""pdserve's Prometheus metrics: one table of series (`SERIES`), recorded through `ray.util.metrics`
in the Ray layouts and through prometheus_client in the single-process layout, under the same names.

    Router actor   ─▶ queue depth and size per pool; rejected, retries, migrations, transfer failures
    Workers        ─▶ per step: batch size, tokens, step time, running / waiting, KV-block use, preemptions;
                      decode side: KV transfer bytes and seconds; speculative decoding's draft, accepted
                      and emitted tokens (tag `method`), acceptance rate and mean accepted length
    KV pairs       ─▶ per (prefill worker, decode worker) pair: transport, probe and live GB/s, transfers,
                      bytes, failures by cause (kv_transfer/pair_stats.py)
    Ingress        ─▶ per request: TTFT, TPOT, inter-token latency, end-to-end, prompt / generation tokens

Names: Ray's exporter prefixes every metric with `ray_`, so the Ray layouts' series are `ray_pdserve_*`.
The single-process layout registers its series with that same prefix (`EXPORT_PREFIX`), so one
dashboard and one set of queries serve both layouts (`exported_series()` is the set).

A metric object records in the process that created it, so each process builds its own set on first
use (`_get`): Ray's when this process is part of a Ray cluster, prometheus_client's when
`use_local_registry()` was called (the single-process server), none otherwise (unit tests without
Ray: every function here is then a no-op).
NOTE: workers call `record_step` once per engine step: a handful of calls (~5 µs each), never one per
token per request.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any, Callable

# NOTE: exported_series is re-exported: callers read the names through this module too
from deployments.metric_series import EXPORT_PREFIX, SERIES, Series, exported_series  # noqa: F401

LOAD_REFRESH_S = 1.0  # how often an idle worker refreshes its load gauges

logger = logging.getLogger(__name__)


class _Recorder:
    """One metric behind the calls the record functions make (`inc`, `set`, `observe`, with `tags`),
    whichever library holds it."""

    __slots__ = ("_m", "_labeled")

    def __init__(self, metric: Any, labeled: bool):
        self._m, self._labeled = metric, labeled

    def _child(self, tags: dict[str, str] | None) -> Any:
        return self._m.labels(**tags) if self._labeled else self._m

    def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        self._child(tags).inc(value)

    def set(self, value: float, tags: dict[str, str] | None = None) -> None:
        self._child(tags).set(value)

    def observe(self, value: float, tags: dict[str, str] | None = None) -> None:
        self._child(tags).observe(value)


def _ray_metric(s: Series) -> Any:
    from ray.util.metrics import Counter, Gauge, Histogram

    if s.kind == "counter":
        return Counter(s.name, description=s.doc, tag_keys=s.tags)
    if s.kind == "gauge":
        return Gauge(s.name, description=s.doc, tag_keys=s.tags)
    return Histogram(s.name, description=s.doc, boundaries=list(s.buckets), tag_keys=s.tags)


def _prom_metric(s: Series, registry: Any) -> _Recorder:
    import prometheus_client as prom

    name = EXPORT_PREFIX + s.name
    if s.kind == "counter":
        m = prom.Counter(name, s.doc, s.tags, registry=registry)
    elif s.kind == "gauge":
        m = prom.Gauge(name, s.doc, s.tags, registry=registry)
    else:
        m = prom.Histogram(name, s.doc, s.tags, registry=registry, buckets=s.buckets)
    return _Recorder(m, bool(s.tags))


class _Metrics:
    """Every pdserve metric, created once per process: an attribute per `Series.attr`."""

    def __init__(self, registry: Any = None) -> None:
        for s in SERIES:
            setattr(self, s.attr, _ray_metric(s) if registry is None else _prom_metric(s, registry))


_metrics: _Metrics | None = None  # Ray's, in a process of a Ray cluster
_local: _Metrics | None = None  # prometheus_client's, once `use_local_registry()` made it
_registry: Any = None  # the local registry
_lock = threading.Lock()
_last_load_refresh = 0.0
# worker id -> (drafted, accepted, emitted) when last exported: the counters go up by the difference.
_spec_seen: dict[str, tuple[int, int, int]] = {}


def use_local_registry() -> Any:
    """Record this process's metrics in a prometheus_client registry of its own (the single-process
    layout, which has no Ray to export them) and return it; `render_local()` is its /metrics text.
    While Ray is up in this process its metrics still go to Ray (a test process may hold both)."""
    global _local, _registry
    import prometheus_client as prom

    with _lock:
        if _registry is None:
            prom.disable_created_metrics()  # NOTE: Ray's exporter has no `_created` series either
            _registry = prom.CollectorRegistry(auto_describe=True)
            _local = _Metrics(_registry)
    return _registry


def render_local() -> tuple[bytes, str]:
    """(body, content type) of the local registry's exposition; empty when none is in use."""
    import prometheus_client as prom

    if _registry is None:
        return b"", prom.CONTENT_TYPE_LATEST
    return prom.generate_latest(_registry), prom.CONTENT_TYPE_LATEST


def _ray_up() -> bool:
    ray = sys.modules.get("ray")  # NOTE: never imported here: the single-process layout runs without it
    return ray is not None and ray.is_initialized()


def _get() -> _Metrics | None:
    global _metrics
    if not _ray_up():
        return _local
    if _metrics is None:
        with _lock:
            if _metrics is None:
                _metrics = _Metrics()
    return _metrics


# ---------------------------------------------------------------------- router
def set_pool_state(pool: str, queue_depth: int, num_workers: int) -> None:
    if (m := _get()) is None:
        return
    tags = {"pool": pool}
    m.queue_depth.set(queue_depth, tags=tags)
    m.pool_workers.set(num_workers, tags=tags)


def count_submitted() -> None:
    if (m := _get()) is not None:
        m.submitted.inc()


def count_rejected() -> None:
    if (m := _get()) is not None:
        m.rejected.inc()


def count_requeue(reason: str) -> None:
    """`reason` is the router counter that went up: "retries" or "migrations"."""
    if (m := _get()) is not None:
        (m.migrations if reason == "migrations" else m.retries).inc()


def count_transfer_failure() -> None:
    if (m := _get()) is not None:
        m.transfer_failures.inc()


def count_worker_death(pool: str) -> None:
    if (m := _get()) is not None:
        m.worker_deaths.inc(tags={"pool": pool})


def count_role_switch(from_role: str, to_role: str) -> None:
    if (m := _get()) is not None:
        m.role_switches.inc(tags={"from_role": from_role, "to_role": to_role})


# ---------------------------------------------------------------------- workers
def record_step(pool: str, worker_id: str, stats: Any, engine: Any) -> None:
    """After each engine step, under the worker's engine lock. `stats` is `engine.last_step`."""
    if (m := _get()) is None:
        return
    tags = {"pool": pool}
    if stats.num_seqs:
        m.batch_size.observe(stats.num_seqs, tags=tags)
        m.step_tokens.observe(stats.num_prefill_tokens + stats.num_decode_tokens, tags=tags)
        m.step_seconds.observe(stats.duration_s, tags=tags)
    wtags = {"pool": pool, "worker_id": worker_id}
    if stats.num_prefill_tokens:
        m.prefill_tokens.inc(stats.num_prefill_tokens, tags=wtags)
    if stats.num_decode_tokens:
        m.decode_tokens.inc(stats.num_decode_tokens, tags=wtags)
    if stats.num_cached_tokens:
        m.cache_hit_tokens.inc(stats.num_cached_tokens, tags=wtags)
    if stats.num_preempted:
        m.preemptions.inc(stats.num_preempted, tags=wtags)
    if stats.num_draft_tokens:
        record_spec(m, wtags, engine.spec_stats())
    _set_load(m, wtags, engine)


def spec_increments(worker_id: str, spec: Any) -> tuple[int, int, int]:
    """(drafted, accepted, emitted) since the last call for `worker_id`; `spec` is the engine's
    cumulative `SpecStats`. An engine whose counters went back (a new one under the same id) counts
    from zero again."""
    now = (spec.num_drafted, spec.num_accepted, spec.num_emitted)
    before = _spec_seen.get(worker_id, (0, 0, 0))
    if any(n < b for n, b in zip(now, before)):
        before = (0, 0, 0)
    _spec_seen[worker_id] = now
    return now[0] - before[0], now[1] - before[1], now[2] - before[2]


def record_spec(m: _Metrics, wtags: dict[str, str], spec: Any) -> None:
    """After a step that verified drafts: the counters by what it added, the gauges to the totals."""
    tags = {**wtags, "method": spec.method}
    drafted, accepted, emitted = spec_increments(wtags["worker_id"], spec)
    for metric, n in ((m.spec_drafted, drafted), (m.spec_accepted, accepted), (m.spec_emitted, emitted)):
        if n:
            metric.inc(n, tags=tags)
    m.spec_acceptance.set(spec.acceptance_rate, tags=tags)
    m.spec_mean_len.set(spec.mean_accepted_length, tags=tags)


def record_load(pool: str, worker_id: str, engine: Any) -> None:
    """From an idle worker's loop: refresh the load gauges (at most once per LOAD_REFRESH_S)."""
    global _last_load_refresh
    now = time.monotonic()
    if now - _last_load_refresh < LOAD_REFRESH_S or (m := _get()) is None:
        return
    _last_load_refresh = now
    try:  # NOTE: called outside the step loop's error handling: a failure here must not end the loop
        _set_load(m, {"pool": pool, "worker_id": worker_id}, engine)
    except Exception:  # noqa: BLE001
        logger.debug("load gauges not recorded", exc_info=True)


def _set_load(m: _Metrics, tags: dict[str, str], engine: Any) -> None:
    bm = engine.block_manager
    m.running.set(engine.num_running, tags=tags)
    m.waiting.set(engine.num_waiting, tags=tags)
    m.kv_used.set(bm.num_used_blocks, tags=tags)
    m.kv_usage.set(bm.num_used_blocks / max(bm.num_blocks, 1), tags=tags)


def record_kv_pull(worker_id: str, nbytes: int, seconds: float) -> None:
    """A decode worker received one request's KV blocks."""
    if (m := _get()) is None:
        return
    m.kv_bytes.inc(nbytes, tags={"pool": "decode", "worker_id": worker_id})
    m.kv_seconds.observe(seconds, tags={"pool": "decode"})


# ---------------------------------------------------------------------- KV pairs
class KVPairMetrics:
    """A `kv_transfer.pair_stats.PairListener`: a decode worker's pairs as the pdserve_kv_pair_* series.

    NOTE: Ray's gauges export only the values set since its last report, so `refresh` sets the pair
    gauges again (at most once per LOAD_REFRESH_S) from the worker's loop, busy or idle."""

    def __init__(self) -> None:
        self._last_refresh = 0.0

    def refresh(self, pairs: Callable[[], list[Any]]) -> None:
        """Set the pair gauges from `pairs()` (copies of the book's pairs), called only when due: this
        runs after every decode step."""
        now = time.monotonic()
        if now - self._last_refresh < LOAD_REFRESH_S or (m := _get()) is None:
            return
        self._last_refresh = now
        for pair in pairs():
            tags = self._tags(pair)
            if pair.probe_gbps is not None:
                m.pair_probe_gbps.set(pair.probe_gbps, tags=tags)
            if pair.live_gbps is not None:
                m.pair_live_gbps.set(pair.live_gbps, tags=tags)

    @staticmethod
    def _tags(pair: Any) -> dict[str, str]:
        return {"src": pair.src, "dst": pair.dst, "transport": pair.transport or "none"}

    def opened(self, pair: Any) -> None:
        if (m := _get()) is not None and pair.probe_gbps is not None:
            m.pair_probe_gbps.set(pair.probe_gbps, tags=self._tags(pair))

    def transferred(self, pair: Any, nbytes: int) -> None:
        if (m := _get()) is None:
            return
        tags = self._tags(pair)
        m.pair_transfers.inc(tags=tags)
        m.pair_bytes.inc(nbytes, tags=tags)
        if pair.live_gbps is not None:
            m.pair_live_gbps.set(pair.live_gbps, tags=tags)

    def failed(self, pair: Any, cause: Any) -> None:
        if (m := _get()) is not None:
            m.pair_failures.inc(tags={**self._tags(pair), "cause": cause.value})


# ---------------------------------------------------------------------- ingress
class RequestTimer:
    """Latencies of one request as its client sees them; `tokens` on each delivery, `finish` once."""

    __slots__ = ("start", "first", "last", "num_tokens", "done")

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None
        self.last = self.start
        self.num_tokens = 0
        self.done = False

    def tokens(self, n: int) -> None:
        if n <= 0 or (m := _get()) is None:
            return
        now = time.perf_counter()
        if self.first is None:
            self.first = now
            m.ttft.observe(now - self.start)
        else:
            m.itl.observe((now - self.last) / n)
        self.last = now
        self.num_tokens += n

    def finish(self, finish_reason: str | None, num_prompt_tokens: int, num_cached_tokens: int = 0) -> None:
        if self.done or (m := _get()) is None:
            return
        self.done = True
        now = time.perf_counter()
        m.requests.inc(tags={"finish_reason": finish_reason or "aborted"})
        if num_prompt_tokens:
            m.prompt_tokens.inc(num_prompt_tokens)
        if num_cached_tokens:
            m.cached_prompt_tokens.inc(num_cached_tokens)
        if self.num_tokens:
            m.generation_tokens.inc(self.num_tokens)
        if finish_reason in (None, "error", "aborted") or self.first is None:
            return  # latencies of failed or abandoned requests would only skew the histograms
        m.e2e.observe(now - self.start)
        if self.num_tokens > 1:
            m.tpot.observe((now - self.first) / (self.num_tokens - 1))
