"""Write docs/guides/grafana/pdserve.json, a Grafana dashboard of pdserve's series (deployments/metric_series.py),
for both layouts (the names are `ray_pdserve_*` in each). `--check`: exit 1 if the file is out of date.

    PYTHONPATH=$PWD python scripts/grafana_dashboard.py [--check]

Import it in Grafana (Dashboards > New > Import) with a Prometheus data source that scrapes Ray's
metrics endpoint (Ray layouts) or the server's /metrics (single-process layout)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "docs" / "guides" / "grafana" / "pdserve.json"
P = "ray_"  # deployments.metric_series.EXPORT_PREFIX

# (title, unit, [(PromQL, legend)]): one panel each, in rows of two.
PANELS = [
    ("Time to first token (p50, p95)", "s", [
        (f"histogram_quantile(0.5, sum by (le) (rate({P}pdserve_time_to_first_token_seconds_bucket[$__rate_interval])))", "p50"),
        (f"histogram_quantile(0.95, sum by (le) (rate({P}pdserve_time_to_first_token_seconds_bucket[$__rate_interval])))", "p95")]),
    ("Inter-token latency (p50, p95)", "s", [
        (f"histogram_quantile(0.5, sum by (le) (rate({P}pdserve_inter_token_latency_seconds_bucket[$__rate_interval])))", "p50"),
        (f"histogram_quantile(0.95, sum by (le) (rate({P}pdserve_inter_token_latency_seconds_bucket[$__rate_interval])))", "p95")]),
    ("Requests ended by finish reason", "reqps", [
        (f"sum by (finish_reason) (rate({P}pdserve_requests_total[$__rate_interval]))", "{{finish_reason}}")]),
    ("Tokens per second", "short", [
        (f"sum(rate({P}pdserve_generation_tokens_total[$__rate_interval]))", "delivered"),
        (f"sum(rate({P}pdserve_prompt_tokens_total[$__rate_interval]))", "prompt"),
        (f"sum(rate({P}pdserve_prompt_tokens_cached_total[$__rate_interval]))", "prompt, from the prefix cache")]),
    ("Queue depth by pool", "short", [
        (f"sum by (pool) ({P}pdserve_queue_depth)", "{{pool}}")]),
    ("Workers by pool", "short", [
        (f"sum by (pool) ({P}pdserve_pool_workers)", "{{pool}}")]),
    ("Running and waiting sequences", "short", [
        (f"sum by (pool, worker_id) ({P}pdserve_running_seqs)", "running {{worker_id}}"),
        (f"sum by (pool, worker_id) ({P}pdserve_waiting_seqs)", "waiting {{worker_id}}")]),
    ("KV-cache use", "percentunit", [
        (f"max by (pool, worker_id) ({P}pdserve_kv_cache_usage)", "{{worker_id}}")]),
    # NOTE: one unit per panel: a batch size on a seconds axis reads as seconds
    ("Engine step time (p50, p95)", "s", [
        (f"histogram_quantile(0.5, sum by (le, pool) (rate({P}pdserve_step_seconds_bucket[$__rate_interval])))", "p50 {{pool}}"),
        (f"histogram_quantile(0.95, sum by (le, pool) (rate({P}pdserve_step_seconds_bucket[$__rate_interval])))", "p95 {{pool}}")]),
    ("Batch size, sequences per step (p50, p95)", "short", [
        (f"histogram_quantile(0.5, sum by (le, pool) (rate({P}pdserve_batch_size_bucket[$__rate_interval])))", "p50 {{pool}}"),
        (f"histogram_quantile(0.95, sum by (le, pool) (rate({P}pdserve_batch_size_bucket[$__rate_interval])))", "p95 {{pool}}")]),
    ("Refusals, retries, migrations, deaths", "short", [
        (f"sum(increase({P}pdserve_requests_rejected_total[$__rate_interval]))", "rejected (429)"),
        (f"sum(increase({P}pdserve_retries_total[$__rate_interval]))", "re-prefilled"),
        (f"sum(increase({P}pdserve_migrations_total[$__rate_interval]))", "moved off a dead decode worker"),
        (f"sum by (pool) (increase({P}pdserve_worker_deaths_total[$__rate_interval]))", "deaths {{pool}}")]),
    ("Pool sizes and role switches", "short", [
        (f"max by (pool) ({P}pdserve_pool_workers)", "workers {{pool}}"),
        (f"sum by (from_role, to_role) (increase({P}pdserve_role_switches_total[$__rate_interval]))",
         "switches {{from_role}} -> {{to_role}}")]),
    ("KV pairs: probe and live GB/s", "short", [
        (f"max by (src, dst, transport) ({P}pdserve_kv_pair_probe_gbps)", "probe {{src}} -> {{dst}} ({{transport}})"),
        (f"max by (src, dst, transport) ({P}pdserve_kv_pair_live_gbps)", "live {{src}} -> {{dst}} ({{transport}})")]),
    ("KV pairs: failures by cause", "short", [
        (f"sum by (src, dst, cause) (increase({P}pdserve_kv_pair_failures_total[$__rate_interval]))",
         "{{src}} -> {{dst}}: {{cause}}"),
        (f"sum(increase({P}pdserve_kv_transfer_failures_total[$__rate_interval]))", "router: transfers failed")]),
    ("KV transfer time (p50, p95)", "s", [
        (f"histogram_quantile(0.5, sum by (le) (rate({P}pdserve_kv_transfer_seconds_bucket[$__rate_interval])))", "p50"),
        (f"histogram_quantile(0.95, sum by (le) (rate({P}pdserve_kv_transfer_seconds_bucket[$__rate_interval])))", "p95")]),
    ("Speculative decoding acceptance", "percentunit", [
        (f"max by (worker_id, method) ({P}pdserve_spec_acceptance_rate)", "{{worker_id}} {{method}}")]),
]


def dashboard() -> dict:
    panels = []
    for i, (title, unit, targets) in enumerate(PANELS):
        panels.append({
            "id": i + 1, "type": "timeseries", "title": title,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "targets": [{"refId": chr(ord("A") + j), "expr": expr, "legendFormat": legend}
                        for j, (expr, legend) in enumerate(targets)]})
    return {
        "title": "pdserve", "uid": "pdserve", "schemaVersion": 39, "version": 1, "editable": True,
        "time": {"from": "now-30m", "to": "now"}, "refresh": "10s", "tags": ["pdserve", "llm"],
        "templating": {"list": [{"name": "datasource", "type": "datasource", "query": "prometheus",
                                 "label": "Prometheus"}]},
        "panels": panels}


def main(argv: list[str]) -> int:
    text = json.dumps(dashboard(), indent=1) + "\n"
    if "--check" in argv:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is out of date: run scripts/grafana_dashboard.py", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
