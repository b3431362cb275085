"""The Grafana dashboard (docs/guides/grafana/pdserve.json) is what scripts/grafana_dashboard.py makes, and
queries only series that pdserve exports (deployments/metrics.py), under the names both layouts use."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from deployments.metrics import exported_series

ROOT = Path(__file__).resolve().parents[1]


def test_dashboard_is_generated_and_queries_only_exported_series():
    proc = subprocess.run([sys.executable, "scripts/grafana_dashboard.py", "--check"], cwd=ROOT,
                          capture_output=True, text=True, env={"PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    board = json.loads((ROOT / "docs/guides/grafana/pdserve.json").read_text())
    queried = {m for p in board["panels"] for t in p["targets"] for m in re.findall(r"ray_pdserve_\w+", t["expr"])}
    assert queried and queried <= exported_series(), sorted(queried - exported_series())
    assert any("kv_pair_failures" in q for q in queried)


def test_snapshot_script_reads_every_panel_query_as_promql_prometheus_can_take(monkeypatch):
    """scripts/dashboard_snapshot.py (run by hand against a real Prometheus) reads each panel's queries
    and replaces Grafana's variables; here only that part, without Prometheus."""
    import importlib.util

    import pytest

    spec = importlib.util.spec_from_file_location("dashboard_snapshot", ROOT / "scripts/dashboard_snapshot.py")
    snap = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, snap)  # dataclasses look their module up there
    spec.loader.exec_module(snap)
    board = json.loads((ROOT / "docs/guides/grafana/pdserve.json").read_text())
    panels = snap.panels_of(board)
    assert [p.title for p in panels] == [p["title"] for p in board["panels"]]  # rows of two, in order
    exprs = [t.expr for p in panels for t in p.targets]
    assert len(exprs) == sum(len(p["targets"]) for p in board["panels"])
    for expr in exprs:
        q = snap.promql(expr, "20s", "2s", "300s")
        assert "$" not in q and q.count("(") == q.count(")"), q
        if "$__rate_interval" in expr:
            assert "[20s]" in q
    assert snap.legend_of("{{src}} -> {{dst}}: {{cause}}", {"src": "p", "dst": "d", "cause": "checksum"}, "") == \
        "p -> d: checksum"
    assert snap.legend_of("", {"pool": "decode"}, "x") == "{pool=decode}"
    with pytest.raises(ValueError, match="Grafana variable"):
        snap.promql("rate(x[$window])", "20s", "2s", "300s")
