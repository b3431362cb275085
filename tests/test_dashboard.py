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
