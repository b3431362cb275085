"""`pdserve status`: the running server as a map, from its `/health` (the router's state in the Ray
layouts, `deployments/cluster/introspect.py`; the engine's counters in the single-process layout).

It reads what the door already serves, over HTTP with the API key, so it runs wherever a client can
reach the server (no Ray client, no cluster address) and shows exactly what `/health` shows:

    pools      size, ready, draining, min/max/desired, the autoscaler's signal, queue depth
    workers    node, device, threads, queue (prefill: prompt tokens) or batch occupancy and KV use (decode)
    KV pairs   each (prefill worker -> decode worker): transport, probe and live GB/s, transfers, bytes,
               failures by cause (kv_transfer/pair_stats.py)
    scaling    the last autoscaling decisions, with their reasons
    roles      with --role-switching: each side's pressure and the role switches

`--json` prints the `/health` document itself.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

API_KEY_ENV = "PDSERVE_API_KEY"


def add_status_parser(sub: Any) -> None:
    s = sub.add_parser("status", help="print the running server's map: pools, workers, queues, KV pairs, scaling",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL (default: %(default)s)")
    s.add_argument("--api-key", default=None, help=f"the server's API key, if it has one (default: ${API_KEY_ENV})")
    s.add_argument("--json", action="store_true", help="print the /health document as JSON instead of the map")
    s.add_argument("--timeout-s", type=float, default=10.0, help="how long to wait for the answer (default: %(default)s)")
    s.set_defaults(func=_status)


class StatusError(RuntimeError):
    """The server could not be read; the message says what to do."""


def fetch_status(url: str, api_key: str | None, timeout_s: float) -> dict[str, Any]:
    """The server's `/health` document with its details (the API key is needed when the server has one)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(url.rstrip("/") + "/health", headers=headers, timeout=timeout_s)
    except httpx.HTTPError as e:
        raise StatusError(f"cannot reach {url}: {type(e).__name__}: {e}") from None
    try:
        doc = r.json()
    except ValueError:
        raise StatusError(f"{url}/health answered {r.status_code} without JSON: is it a pdserve server?") from None
    if set(doc) <= {"status"}:
        if doc.get("status") == "starting":
            raise StatusError(f"{url} is starting; retry shortly")
        raise StatusError(f"{url}/health shows no details without the API key: pass --api-key or set ${API_KEY_ENV}")
    return doc


def _status(args: argparse.Namespace) -> int:
    try:
        doc = fetch_status(args.url, args.api_key or os.environ.get(API_KEY_ENV), args.timeout_s)
    except StatusError as e:
        print(f"pdserve status: {e}", file=sys.stderr)
        return 1
    print(json.dumps(doc, indent=2, sort_keys=True) if args.json else render(doc, args.url))
    return 0 if doc.get("status") == "ok" else 3


# ---------------------------------------------------------------------- the map
def _pct(part: float | None, whole: float | None) -> str:
    return "-" if part is None or not whole else f"{100 * part / whole:.0f}%"


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _gbps(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} GB/s"


def _table(rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def render(doc: dict[str, Any], url: str = "") -> str:
    """`/health`'s document as the map a person reads."""
    head = f"pdserve at {url}  model {doc.get('model', '?')}  status {doc.get('status')}"
    router = doc.get("router")
    if router is None:
        return "\n".join([head, *_single(doc)])
    return "\n".join([head, *_pools(router), *_workers(router), *_pairs(router.get("kv_pairs", [])),
                      *_decisions(router.get("decisions", [])), *_roles(router.get("roles")), *_counters(router)])


def _single(doc: dict[str, Any]) -> list[str]:
    free, total = doc.get("num_free_blocks"), doc.get("num_blocks")
    used = None if free is None or total is None else total - free
    return ["layout: single process (one engine, no Ray, no KV transfer)",
            *_table([["requests", "running", "waiting", "KV blocks used", "steps", "last error"],
                     [str(doc.get("num_requests")), str(doc.get("num_running")), str(doc.get("num_waiting")),
                      f"{used}/{total} ({_pct(used, total)})", str(doc.get("num_steps")),
                      str(doc.get("last_error") or "-")]])]


def _pools(r: dict[str, Any]) -> list[str]:
    rows = [["pool", "workers", "ready", "draining", "min", "max", "desired", "queue", "signal"]]
    for name, p in r.get("pools", {}).items():
        rows.append([name, str(p["size"]), str(p["ready"]), str(p["draining"]), str(p["min"]), str(p["max"]),
                     str(p["desired"]), str(r.get("queues", {}).get(name, "-")), p.get("signal") or "-"])
    return ["pools", *_table(rows)]


def _where(w: dict[str, Any]) -> list[str]:
    threads = w.get("num_threads")
    return [w.get("node_ip") or "?", w.get("device") or "?", str(threads) if threads else "default"]


def _workers(r: dict[str, Any]) -> list[str]:
    rows = [["worker", "pool", "node", "device", "threads", "state", "queue / batch", "KV blocks used"]]
    max_seqs = r.get("max_num_seqs")
    for wid, w in sorted(r.get("prefill", {}).items()):
        rows.append([wid, "prefill", *_where(w), _state(w), f"{w['queued_prompt_tokens']} prompt tokens queued", "-"])
    for wid, w in sorted(r.get("decode", {}).items()):
        total, free = w.get("num_blocks"), w.get("free_blocks")
        used = None if total is None or free is None else total - free
        batch = f"{w['running']}/{max_seqs} running ({_pct(w['running'], max_seqs)}), {w.get('waiting', 0)} waiting"
        rows.append([wid, "decode", *_where(w), _state(w), batch,
                     "-" if used is None else f"{used}/{total} ({_pct(used, total)})"])
    return ["workers", *_table(rows)]


def _state(w: dict[str, Any]) -> str:
    if w.get("switching_to"):
        return f"switching to {'mixed' if w.get('mixed') else w['switching_to']}"
    if w.get("mixed") and w.get("ready"):
        return "ready, mixed"
    return "draining" if w.get("draining") else ("ready" if w.get("ready") else "starting")


def _pairs(pairs: list[dict[str, Any]]) -> list[str]:
    if not pairs:
        return ["KV pairs: none opened yet"]
    rows = [["prefill -> decode", "transport", "probe", "live", "transfers", "bytes", "failures by cause"]]
    for p in sorted(pairs, key=lambda p: (p["src"], p["dst"])):
        fails = ", ".join(f"{k} {v}" for k, v in sorted(p["failures"].items())) or "none"
        rows.append([f"{p['src']} -> {p['dst']}", p["transport"] or "-", _gbps(p["probe_gbps"]),
                     _gbps(p["live_gbps"]), str(p["num_transfers"]), _bytes(p["num_bytes"]), fails])
    notes = [f"  note {p['src']} -> {p['dst']}: {p['note']}" for p in pairs if p.get("note")]
    return ["KV pairs", *_table(rows), *notes]


def _decisions(decisions: list[dict[str, Any]]) -> list[str]:
    if not decisions:
        return ["scaling decisions: none yet"]
    rows = [[time.strftime("%H:%M:%S", time.localtime(d["time"])), d["pool"], d["action"],
             f"{d['from']} -> {d['to']}", d["reason"]] for d in decisions]
    return ["scaling decisions (latest last)", *_table(rows)]


def _roles(roles: dict[str, Any] | None) -> list[str]:
    """The role controller (`--role-switching`): each side's pressure against its targets, the switches."""
    if roles is None:
        return []
    pr = roles.get("pressure")
    out = ["role switching" + ("" if pr is None else
                               f": prefill {pr['prefill']:.2f} of its targets ({pr['prefill_why']}); "
                               f"decode {pr['decode']:.2f} ({pr['decode_why']})")]
    rows = [[time.strftime("%H:%M:%S", time.localtime(d["time"])), d["worker_id"], f"{d['from']} -> {d['to']}",
             "done" if d.get("completed_at") else "under way", d["reason"]] for d in roles.get("decisions", [])]
    return [*out, *_table(rows)] if rows else [*out, "  no switch yet"]


def _counters(r: dict[str, Any]) -> list[str]:
    c = r.get("counters", {})
    return ["counters: " + "  ".join(f"{k}={v}" for k, v in c.items())] if c else []
