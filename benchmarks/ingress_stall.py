"""How long an innocent stream stalls beside an expensive-but-valid (or refused) request: the longest gap
between its tokens alone, and beside each attack, on the single-process server (the engine and the HTTP
app in this process, `LocalEngineBackend`). The tests judge the same things structurally
(tests/deployments/test_ingress.py, tests/engine/test_structured.py); this script measures the gaps.

```
 stream (greedy, ignore_eos) ──HTTP──▶ uvicorn ──▶ LocalEngineBackend ──▶ LLMEngine
 after a few tokens: one attack ──HTTP──▶ the same server; the stream's longest gap is recorded
```

Attacks: a 4 MiB prompt (tokenized off the loop, then refused as too long); a chat body made large by
its `role`; a JSON schema of 16 strings with `maxLength: 2000` (a grammar that compiles for tens of
seconds: off the step loop, refused once past `grammar_compile_timeout_s`); a schema nested 250 deep and
`maxLength: 1e12` (refused at the door). Run it on an idle host; the figures go to results.md.

    .venv/bin/python benchmarks/ingress_stall.py [--tokens 120 --threads 1 --json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from benchmarks.common import MODEL_NAME, engine_http_server  # noqa: E402
from engine import EngineConfig  # noqa: E402

CHAT = "/v1/chat/completions"


def _deep(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


def _schema_body(schema: dict) -> dict:
    return {"model": MODEL_NAME, "max_tokens": 8, "messages": [{"role": "user", "content": "Fill the form."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "form", "schema": schema}}}


ATTACKS = {
    "none": None,
    "4 MiB prompt": ("/v1/completions", {"model": MODEL_NAME, "prompt": "hello world, this is text " * 160_000}),
    "3 MB chat role": (CHAT, {"model": MODEL_NAME, "max_tokens": 2,
                              "messages": [{"role": "user" + " x" * 1_500_000, "content": "hi"}]}),
    "16 x maxLength 2000": (CHAT, _schema_body({"type": "object", "properties": {
        f"p{i}": {"type": "string", "maxLength": 2000} for i in range(16)}})),
    "schema depth 250": (CHAT, _schema_body(_deep(250))),
    "maxLength 1e12": (CHAT, _schema_body({"type": "string", "maxLength": 1e12})),
}


def measure(url: str, attack: tuple[str, dict] | None, tokens: int, warmup: int = 5) -> dict:
    body = {"model": MODEL_NAME, "prompt": "Count to one thousand:", "max_tokens": tokens, "ignore_eos": True,
            "temperature": 0, "stream": True}
    arrivals: list[float] = []
    result: dict = {}

    def send() -> None:
        t0 = time.monotonic()
        r = httpx.post(url + attack[0], json=attack[1], timeout=600)
        result.update(status=r.status_code, seconds=round(time.monotonic() - t0, 2),
                      error=(r.json().get("error") or {}).get("message", "")[:120] if r.status_code != 200 else "")

    thread = None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                arrivals.append(time.monotonic())
                if attack is not None and len(arrivals) == warmup:
                    thread = threading.Thread(target=send)
                    thread.start()
    if thread is not None:
        thread.join(600)
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return {"longest_gap_s": round(max(gaps), 3), "median_gap_s": round(sorted(gaps)[len(gaps) // 2], 3), **result}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=120, help="tokens of the innocent stream per row")
    p.add_argument("--threads", type=int, default=1, help="the engine's torch threads")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()
    rows = {}
    with engine_http_server(EngineConfig(num_threads=args.threads)) as url:
        measure(url, None, 8)  # warm up
        for name, attack in ATTACKS.items():
            rows[name] = measure(url, attack, args.tokens)
            row = rows[name]
            print(f"{name:>22}: longest gap {row['longest_gap_s']:.3f} s (median {row['median_gap_s']:.3f} s)"
                  + (f"; attack answered {row['status']} after {row['seconds']:.2f} s {row['error']}"
                     if attack else ""), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
