"""Every pdserve metric, as data: `SERIES` (name, type, help, tags, buckets). `deployments/metrics.py`
records them (through Ray or prometheus_client), `scripts/grafana_dashboard.py` and the tests read the
names from here; `exported_series()` is what a scrape shows in every layout."""

from __future__ import annotations

from typing import NamedTuple

# Seconds, wide enough for a GPU's few-ms steps and a CPU's multi-second prompts.
LATENCY_BUCKETS_S = [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0,
                     5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0]
PER_TOKEN_BUCKETS_S = [0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                       0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0]
COUNT_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
EXPORT_PREFIX = "ray_"  # what Ray's exporter puts before every name; the local registry does the same


_POOL = ("pool",)
_WORKER = ("pool", "worker_id")
_SPEC = ("pool", "worker_id", "method")
_PAIR = ("src", "dst", "transport")


class Series(NamedTuple):
    """One metric: `attr` is its attribute on `_Metrics`, `name` its name before the export prefix."""

    attr: str
    name: str
    kind: str  # "counter", "gauge" or "histogram"
    doc: str
    tags: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()


def _c(attr: str, name: str, doc: str, tags: tuple[str, ...] = ()) -> Series:
    return Series(attr, name, "counter", doc, tags)


def _g(attr: str, name: str, doc: str, tags: tuple[str, ...] = ()) -> Series:
    return Series(attr, name, "gauge", doc, tags)


def _h(attr: str, name: str, doc: str, buckets: list[float], tags: tuple[str, ...] = ()) -> Series:
    return Series(attr, name, "histogram", doc, tags, tuple(buckets))


SERIES: tuple[Series, ...] = (
    # router
    _g("queue_depth", "pdserve_queue_depth", "Requests waiting for a worker of this pool "
       "(prefill: not yet prefilled; decode: prefilled, waiting for a slot).", _POOL),
    _g("pool_workers", "pdserve_pool_workers", "Workers in the pool (ready or starting).", _POOL),
    _c("submitted", "pdserve_requests_submitted_total", "Requests the router accepted."),
    _c("rejected", "pdserve_requests_rejected_total", "Requests refused because the queue was full."),
    _c("retries", "pdserve_retries_total", "Requests prefilled again after a prefill worker died or a KV "
       "transfer failed."),
    _c("migrations", "pdserve_migrations_total", "Requests moved off a dead decode worker."),
    _c("transfer_failures", "pdserve_kv_transfer_failures_total", "KV transfers that failed."),
    _c("worker_deaths", "pdserve_worker_deaths_total", "Workers found dead.", _POOL),
    _c("role_switches", "pdserve_role_switches_total",
       "Workers moved from one role to another by the role controller (begun).", ("from_role", "to_role")),
    # workers, per step
    _g("running", "pdserve_running_seqs", "Sequences in the worker's running batch.", _WORKER),
    _g("waiting", "pdserve_waiting_seqs", "Sequences waiting in the worker's engine.", _WORKER),
    _g("kv_used", "pdserve_kv_blocks_used", "KV-cache blocks in use.", _WORKER),
    _g("kv_usage", "pdserve_kv_cache_usage", "Fraction of the worker's KV-cache blocks in use.", _WORKER),
    _h("batch_size", "pdserve_batch_size", "Sequences per engine step.", COUNT_BUCKETS, _POOL),
    _h("step_tokens", "pdserve_step_tokens", "Tokens computed per engine step.", COUNT_BUCKETS, _POOL),
    _h("step_seconds", "pdserve_step_seconds", "Engine step time.", LATENCY_BUCKETS_S, _POOL),
    _c("prefill_tokens", "pdserve_prefill_tokens_total", "Prompt tokens computed (recomputation after "
       "preemption or migration included).", _WORKER),
    _c("decode_tokens", "pdserve_decode_tokens_total", "Decode tokens computed.", _WORKER),
    _c("cache_hit_tokens", "pdserve_prefix_cache_hit_tokens_total", "Prompt tokens taken from the prefix "
       "cache instead of computed.", _WORKER),
    _c("preemptions", "pdserve_preemptions_total", "Sequences preempted for lack of KV blocks.", _WORKER),
    # speculative decoding, decode side
    _c("spec_drafted", "pdserve_spec_draft_tokens_total", "Draft tokens verified by the model.", _SPEC),
    _c("spec_accepted", "pdserve_spec_accepted_tokens_total", "Draft tokens verification kept.", _SPEC),
    _c("spec_emitted", "pdserve_spec_emitted_tokens_total", "Tokens that verifying sequence-steps produced: "
       "accepted drafts plus the model's own token of each.", _SPEC),
    _g("spec_acceptance", "pdserve_spec_acceptance_rate", "Accepted / drafted tokens since the worker "
       "started.", _SPEC),
    _g("spec_mean_len", "pdserve_spec_mean_accepted_length", "Tokens per verifying sequence-step "
       "(1 + accepted drafts) since the worker started.", _SPEC),
    # KV transfer, decode side
    _c("kv_bytes", "pdserve_kv_transfer_bytes_total", "KV-cache bytes received.", _WORKER),
    _h("kv_seconds", "pdserve_kv_transfer_seconds", "Time to pull one request's KV blocks.",
       LATENCY_BUCKETS_S, _POOL),
    # KV pairs, decode side (kv_transfer/pair_stats.py)
    _g("pair_probe_gbps", "pdserve_kv_pair_probe_gbps", "GB/s the pair's channel probe measured when it "
       "opened.", _PAIR),
    _g("pair_live_gbps", "pdserve_kv_pair_live_gbps", "GB/s of the pair's recent transfers (moving "
       "average).", _PAIR),
    _c("pair_transfers", "pdserve_kv_pair_transfers_total", "KV transfers the pair completed.", _PAIR),
    _c("pair_bytes", "pdserve_kv_pair_bytes_total", "KV-cache bytes the pair moved.", _PAIR),
    _c("pair_failures", "pdserve_kv_pair_failures_total", "KV transfers of the pair that failed, by cause "
       "(timeout, peer_gone, lease_expired, checksum, other).", (*_PAIR, "cause")),
    # ingress, per request
    _h("ttft", "pdserve_time_to_first_token_seconds", "From the request to its first token.",
       LATENCY_BUCKETS_S),
    _h("tpot", "pdserve_time_per_output_token_seconds", "Per request: (end-to-end - TTFT) / "
       "(output tokens - 1).", PER_TOKEN_BUCKETS_S),
    _h("itl", "pdserve_inter_token_latency_seconds", "Gap between token deliveries, per token.",
       PER_TOKEN_BUCKETS_S),
    _h("e2e", "pdserve_e2e_request_latency_seconds", "From the request to its last token.",
       LATENCY_BUCKETS_S),
    _c("requests", "pdserve_requests_total", "Requests that ended, by finish reason.", ("finish_reason",)),
    _c("prompt_tokens", "pdserve_prompt_tokens_total", "Prompt tokens of ended requests."),
    _c("cached_prompt_tokens", "pdserve_prompt_tokens_cached_total", "Prompt tokens of ended requests that "
       "their prefill found in the prefix cache."),
    _c("generation_tokens", "pdserve_generation_tokens_total", "Tokens delivered to clients."),
)


def exported_series() -> set[str]:
    """The sample names a scrape shows (a histogram's `_bucket`, `_sum` and `_count`), with the export
    prefix: what a dashboard queries, the same in every layout."""
    out = set()
    for s in SERIES:
        name = EXPORT_PREFIX + s.name
        out |= {name + x for x in ("_bucket", "_sum", "_count")} if s.kind == "histogram" else {name}
    return out
