"""Draw the Grafana dashboard's panels from a real run: docs/guides/grafana/pdserve.png.

No Grafana server installs on the build hosts, so this is not a Grafana screenshot. It is every panel
query of docs/guides/grafana/pdserve.json (scripts/grafana_dashboard.py) evaluated by a real Prometheus
that scraped a real pdserve under a bounded load, drawn by matplotlib in the dashboard's order and with
its titles and legends:

    pdserve (--url, or --serve: `pdserve serve --layout single` on a free 127.0.0.1 port)
      ▲ GET /metrics every --scrape-s                      ▲ --requests completions, in waves
    prometheus (the `prometheus` binary: Debian's package; a temp config and data dir, 127.0.0.1)
      ▲ /api/v1/query_range for every panel query over the run ($__rate_interval = --rate-interval)
    matplotlib: one subplot per panel ──▶ --out (PNG)

    apt-get install prometheus     # once
    PYTHONPATH=$PWD python scripts/dashboard_snapshot.py --serve

Exit status 1 when Prometheus rejects a query (the query is wrong: fix scripts/grafana_dashboard.py);
queries that returned no data are listed (in the single-process layout the Ray layouts' series, such as
the KV pairs', the router's queues and pools, have none). Only 127.0.0.1 is contacted.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
BOARD = ROOT / "docs" / "guides" / "grafana" / "pdserve.json"
OUT = ROOT / "docs" / "guides" / "grafana" / "pdserve.png"
HOST = "127.0.0.1"


# ---------------------------------------------------------------------- the dashboard's queries
@dataclass(frozen=True, slots=True)
class Target:
    expr: str  # PromQL as the dashboard holds it (with Grafana's variables)
    legend: str  # Grafana's legendFormat: "{{label}}" is the series' label value


@dataclass(frozen=True, slots=True)
class Panel:
    title: str
    unit: str
    targets: tuple[Target, ...]


def panels_of(board: dict[str, Any]) -> list[Panel]:
    """Every panel of a Grafana dashboard (rows in `gridPos` order: top to bottom, left to right)."""
    out = []
    for p in sorted(board["panels"], key=lambda p: (p["gridPos"]["y"], p["gridPos"]["x"])):
        targets = tuple(Target(t["expr"], t.get("legendFormat", "")) for t in p.get("targets", []) if t.get("expr"))
        if targets:
            out.append(Panel(p["title"], p.get("fieldConfig", {}).get("defaults", {}).get("unit", ""), targets))
    return out


_GRAFANA_VARS = re.compile(r"\$(__rate_interval|__interval|__range)\b|\$\{(__rate_interval|__interval|__range)\}")


def promql(expr: str, rate_interval: str, interval: str, range_: str) -> str:
    """`expr` with Grafana's built-in variables replaced by durations Prometheus reads; any other `$`
    variable is an error (Prometheus would reject it, and the dashboard defines none in its queries)."""
    values = {"__rate_interval": rate_interval, "__interval": interval, "__range": range_}
    out = _GRAFANA_VARS.sub(lambda m: values[m.group(1) or m.group(2)], expr)
    if "$" in out:
        raise ValueError(f"a Grafana variable this script does not know in {expr!r}")
    return out


def legend_of(legend: str, labels: dict[str, str], expr: str) -> str:
    """Grafana's legend: `{{name}}` replaced by the series' label (missing: empty); none: the labels."""
    if legend:
        return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), legend)
    return "{" + ", ".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}" if labels else expr[:40]


# ---------------------------------------------------------------------- processes
def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout_s: float, ok=lambda r: r.status_code == 200, proc: subprocess.Popen | None = None,
              what: str = "") -> httpx.Response:
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"{what} exited with status {proc.returncode} before {url} answered")
        try:
            r = httpx.get(url, timeout=5)
            if ok(r):
                return r
            last = r.status_code
        except httpx.HTTPError as e:
            last = e
        time.sleep(0.5)
    raise SystemExit(f"{what or url}: no answer in {timeout_s:.0f}s ({last!r})")


def stop(proc: subprocess.Popen | None, what: str) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        print(f"{what} did not stop in 30s; killing it", file=sys.stderr)
        proc.kill()
        proc.wait(10)


def start_pdserve(log_dir: Path, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = open(log_dir / "pdserve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "deployments.cli", "serve", "--layout", "single", "--host", HOST,
                             "--port", str(port), *extra], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    url = f"http://{HOST}:{port}"
    wait_http(f"{url}/health", 600, proc=proc, what="pdserve serve")
    return proc, url


def start_prometheus(binary: str, target: str, scrape_s: float, work: Path,
                     api_key: str | None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    host_port = target.split("://", 1)[1].rstrip("/")
    job = {"job_name": "pdserve", "scrape_interval": f"{scrape_s:g}s", "scrape_timeout": f"{scrape_s:g}s",
           "metrics_path": "/metrics", "static_configs": [{"targets": [host_port]}]}
    if api_key:
        job["authorization"] = {"credentials": api_key}
    config = work / "prometheus.yml"
    # NOTE: JSON is YAML: no YAML writer needed
    config.write_text(json.dumps({"global": {"scrape_interval": f"{scrape_s:g}s"}, "scrape_configs": [job]}))
    log = open(work / "prometheus.log", "w")
    proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={work / 'data'}",
                             f"--web.listen-address={HOST}:{port}", "--log.level=warn"],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://{HOST}:{port}"
    wait_http(f"{url}/-/ready", 60, proc=proc, what="prometheus")
    return proc, url


# ---------------------------------------------------------------------- the load
WORDS = ("the quick brown fox jumps over a lazy dog while seven small robots count prime numbers in a quiet "
         "library near the old harbour").split()


def one_request(url: str, i: int, api_key: str | None) -> str:
    """Request `i` of the load: varied prompt lengths and output lengths, every third streamed, every
    fifth a chat, every seventh constrained by a regex; returns its outcome."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    prompt = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(8 + (i * 13) % 120))
    body: dict[str, Any] = {"max_tokens": 8 + (i * 7) % 40, "temperature": 0.0 if i % 2 else 0.8, "seed": i}
    path = "/v1/completions"
    if i % 5 == 0:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if i % 7 == 0:
        body["guided_regex"] = "(yes|no), because [a-z ]{5,30}\\."
    if i % 3 == 0:
        body["stream"] = True
        with httpx.stream("POST", url + path, json=body, headers=headers, timeout=300) as r:
            for _ in r.iter_lines():
                pass
            return f"stream {r.status_code}"
    r = httpx.post(url + path, json=body, headers=headers, timeout=300)
    return str(r.status_code)


def drive(url: str, num_requests: int, concurrency: int, waves: int, pause_s: float,
          api_key: str | None) -> dict[str, int]:
    """`num_requests` requests in `waves` waves, `concurrency` at a time, `pause_s` apart (the panels
    then show load and idle)."""
    outcomes: dict[str, int] = {}
    per_wave = -(-num_requests // waves)
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        for w in range(waves):
            ids = range(w * per_wave, min(num_requests, (w + 1) * per_wave))
            for outcome in pool.map(lambda i: one_request(url, i, api_key), ids):
                outcomes[outcome] = outcomes.get(outcome, 0) + 1
            print(f"wave {w + 1}/{waves}: {len(ids)} requests done", flush=True)
            if w + 1 < waves:
                time.sleep(pause_s)
    return outcomes


# ---------------------------------------------------------------------- evaluating and drawing
@dataclass(slots=True)
class Result:
    panel: Panel
    series: list[tuple[str, list[float], list[float]]]  # (legend, times since the start, values)
    rejected: list[str]  # "query: Prometheus's error"
    empty: list[str]  # queries that returned no series


def evaluate(prom: str, panels: list[Panel], start: float, end: float, step_s: float,
             rate_interval: str) -> list[Result]:
    results = []
    for panel in panels:
        res = Result(panel, [], [], [])
        for t in panel.targets:
            query = promql(t.expr, rate_interval, f"{step_s:g}s", f"{max(1, int(end - start))}s")
            r = httpx.get(f"{prom}/api/v1/query_range", timeout=60,
                          params={"query": query, "start": start, "end": end, "step": step_s})
            doc = r.json()
            if doc.get("status") != "success":
                res.rejected.append(f"{query}: {doc.get('errorType')}: {doc.get('error')}")
                continue
            data = [s for s in doc["data"]["result"] if s["values"]]
            if not data:
                res.empty.append(query)
            for s in data:
                xs = [float(ts) - start for ts, _ in s["values"]]
                ys = [float(v) for _, v in s["values"]]
                res.series.append((legend_of(t.legend, s["metric"], query), xs, ys))
        results.append(res)
    return results


_SCALE = {"percentunit": (100.0, "%"), "s": (1.0, "seconds"), "reqps": (1.0, "requests/s"), "short": (1.0, "")}


def draw(results: list[Result], out: Path, caption: str, span_s: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 2
    rows = -(-len(results) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(15, 3.1 * rows), squeeze=False)
    for ax, res in zip(axes.flat, results):
        scale, label = _SCALE.get(res.panel.unit, (1.0, res.panel.unit))
        ax.set_title(res.panel.title, fontsize=10, loc="left")
        for legend, xs, ys in res.series:
            ax.plot(xs, [y * scale for y in ys], linewidth=1.2, label=legend)
        if res.series:
            ax.legend(fontsize=7, loc="upper left", ncol=2 if len(res.series) > 4 else 1, framealpha=0.7)
        else:
            ax.text(0.5, 0.5, "no data in this run", ha="center", va="center", color="0.5", transform=ax.transAxes)
            ax.set_xlim(0, span_s)
        if res.rejected:
            ax.text(0.5, 0.2, "query rejected", ha="center", color="red", transform=ax.transAxes)
        ax.set_ylabel(label, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(results):]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("seconds since the load began", fontsize=8)
    fig.suptitle(textwrap.fill(caption, 190), fontsize=9, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    plt.close(fig)


# ---------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running pdserve on 127.0.0.1 (its /metrics is scraped)")
    where.add_argument("--serve", action="store_true", help="start `pdserve serve --layout single` for the run")
    ap.add_argument("--serve-args", default="", help="more `pdserve serve` arguments with --serve")
    ap.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY"))
    ap.add_argument("--requests", type=int, default=36)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--waves", type=int, default=3)
    ap.add_argument("--pause-s", type=float, default=15.0, help="idle time between waves")
    ap.add_argument("--scrape-s", type=float, default=2.0)
    ap.add_argument("--rate-interval", default="20s", help="what $__rate_interval stands for")
    ap.add_argument("--prometheus", default=shutil.which("prometheus") or "prometheus")
    ap.add_argument("--board", type=Path, default=BOARD)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    if not 1 <= args.requests <= 200:
        ap.error("--requests must be in [1, 200]: a bounded load")
    if args.url and httpx.URL(args.url).host not in (HOST, "localhost"):
        ap.error(f"--url must be on {HOST}: this script drives load only against this host")
    if shutil.which(args.prometheus) is None:
        ap.error(f"{args.prometheus!r} not found: apt-get install prometheus")
    panels = panels_of(json.loads(args.board.read_text()))

    work = Path(tempfile.mkdtemp(prefix="pdserve-dashboard-"))
    server = prom = None
    try:
        if args.serve:
            print("starting pdserve serve --layout single ...", flush=True)
            server, url = start_pdserve(work, args.serve_args.split())
        else:
            url = args.url.rstrip("/")
        prom, prom_url = start_prometheus(args.prometheus, url, args.scrape_s, work, args.api_key)
        wait_http(f"{prom_url}/api/v1/targets", 60, what="the first scrape of pdserve",
                  ok=lambda r: any(t["health"] == "up" for t in r.json()["data"]["activeTargets"]))
        version = httpx.get(f"{prom_url}/api/v1/status/buildinfo", timeout=10).json()["data"]["version"]
        start = time.time()
        outcomes = drive(url, args.requests, args.concurrency, args.waves, args.pause_s, args.api_key)
        time.sleep(3 * args.scrape_s)  # the last scrape sees the end of the load
        end = time.time()
        results = evaluate(prom_url, panels, start - 2 * args.scrape_s, end, args.scrape_s, args.rate_interval)
    finally:
        stop(prom, "prometheus")
        stop(server, "pdserve")
    caption = (f"pdserve's Grafana dashboard (docs/guides/grafana/pdserve.json): each panel's queries evaluated by "
               f"Prometheus {version} over a {end - start:.0f} s run of {args.requests} requests against "
               f"{'a single-process pdserve' if args.serve else url}, scraped every {args.scrape_s:g} s, "
               f"$__rate_interval = {args.rate_interval}; drawn by matplotlib (not a Grafana screenshot)")
    draw(results, args.out, caption, end - start)
    shutil.rmtree(work, ignore_errors=True)
    print(f"load: {outcomes}")
    rejected = [q for r in results for q in r.rejected]
    for r in results:
        for q in r.empty:
            print(f"no data: [{r.panel.title}] {q}")
    print(f"{sum(len(p.targets) for p in panels)} queries in {len(panels)} panels; "
          f"{sum(len(r.empty) for r in results)} without data; {len(rejected)} rejected; wrote {args.out}")
    for q in rejected:
        print(f"REJECTED: {q}", file=sys.stderr)
    return 1 if rejected else 0


if __name__ == "__main__":
    sys.exit(main())
