"""`pdserve bench` against a fake OpenAI streaming server (FastAPI + uvicorn in a thread; no Ray, no model).

The fake answers /v1/completions with one chunk per token, `TOKEN_SLEEP_S` apart, after a
`FIRST_SLEEP_S` "prefill", and a usage chunk when asked; so TTFT and TPOT have known lower bounds.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

fastapi = pytest.importorskip("fastapi")

from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse, StreamingResponse  # noqa: E402

from deployments.bench_cli import BenchConfig, arrival_offsets, make_requests, run_benchmark  # noqa: E402
from deployments.cli import main as cli_main  # noqa: E402
from helpers import ThreadedServer  # noqa: E402

FIRST_SLEEP_S = 0.03
TOKEN_SLEEP_S = 0.01
MODEL = "fake-model"
NO_USAGE_MODEL = "fake-model-no-usage"  # a server that ignores stream_options


def _fake_app() -> FastAPI:
    app = FastAPI()
    app.state.bodies = []

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        app.state.bodies.append(body)
        if body.get("model") not in (MODEL, NO_USAGE_MODEL):
            return JSONResponse({"error": {"message": "no such model"}}, status_code=404)
        n = int(body["max_tokens"])
        usage = bool((body.get("stream_options") or {}).get("include_usage")) and body["model"] == MODEL
        # NOTE: prompts starting with token 7 get two tokens per chunk: the usage count must win.
        per_chunk = 2 if isinstance(body["prompt"], list) and body["prompt"][0] == 7 else 1

        async def gen():
            await asyncio.sleep(FIRST_SLEEP_S)
            sent = 0
            while sent < n:
                if sent:
                    await asyncio.sleep(TOKEN_SLEEP_S * per_chunk)
                k = min(per_chunk, n - sent)
                sent += k
                finish = "length" if sent == n else None
                yield "data: " + json.dumps({"choices": [{"index": 0, "text": "x" * k, "finish_reason": finish}]}) + "\n\n"
            if usage:
                u = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n, "total_tokens": n,
                     "prompt_tokens_details": {"cached_tokens": len(body["prompt"]) // 2}}
                yield "data: " + json.dumps({"choices": [], "usage": u}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def server():
    app = _fake_app()
    srv = ThreadedServer(app)
    srv.app = app
    yield srv
    srv.stop()


def test_workload_is_reproducible_and_in_range():
    cfg = BenchConfig(base_url="http://x", model=MODEL, num_prompts=50, input_len_range=(4, 9),
                      output_len_range=(2, 5), request_rate=10.0, vocab_size=1000, seed=3)
    a, b = make_requests(cfg), make_requests(cfg)
    assert a == b
    assert all(4 <= len(r.prompt) <= 9 and 2 <= r.max_tokens <= 5 for r in a)
    assert all(100 <= t < 1000 for r in a for t in r.prompt)
    offs = arrival_offsets(cfg)
    assert offs[0] == 0 and offs == sorted(offs)
    assert 2.0 < offs[-1] < 10.0  # 49 gaps of mean 0.1 s
    assert arrival_offsets(BenchConfig(base_url="http://x", model=MODEL, num_prompts=5)) == [0.0] * 5
    with pytest.raises(ValueError, match="input_len_range"):
        BenchConfig(base_url="http://x", model=MODEL, input_len_range=(5, 2))


def test_shared_prefix_workload():
    cfg = BenchConfig(base_url="http://x", model=MODEL, num_prompts=40, input_len_range=(3, 6), vocab_size=1000,
                      prefix_groups=3, prefix_len=8, seed=5)
    reqs = make_requests(cfg)
    heads = {tuple(r.prompt[:8]) for r in reqs}
    assert len(heads) == 3  # every prompt starts with one of the 3 prefixes, and all 3 are used
    assert all(11 <= len(r.prompt) <= 14 for r in reqs)
    assert len({tuple(r.prompt[8:]) for r in reqs}) > 30  # each goes on with its own tokens
    with pytest.raises(ValueError, match="prefix_groups and prefix_len"):
        BenchConfig(base_url="http://x", model=MODEL, prefix_groups=2)


def test_metrics_are_sane(server, tmp_path):
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    cfg = BenchConfig(base_url=server.url, model=MODEL, num_prompts=12, request_rate=50.0, max_concurrency=6,
                      input_len_range=(8, 16), output_len_range=(5, 15), vocab_size=500, seed=1,
                      timeout_s=30, slo_ttft_ms=10_000, slo_tpot_ms=TOKEN_SLEEP_S * 1000 * 0.5,
                      progress=False, result_json=str(out_json), plot=str(out_png))
    res = run_benchmark(cfg)
    m = res["metrics"]
    assert m["completed"] == 12 and m["failed"] == 0 and m["usage_reported"] == 12
    assert m["total_output_tokens"] == sum(r.max_tokens for r in make_requests(cfg))
    assert m["total_prompt_tokens"] == sum(len(r.prompt) for r in make_requests(cfg))
    assert m["cached_prompt_tokens"] == sum(len(r.prompt) // 2 for r in make_requests(cfg))
    # what was sent: token-id prompts, ignore_eos, usage requested
    body = server.app.state.bodies[-1]
    assert body["ignore_eos"] is True and body["stream"] is True and body["stream_options"]["include_usage"]
    assert isinstance(body["prompt"], list) and all(isinstance(t, int) for t in body["prompt"])
    for r in res["requests"]:
        assert r["ttft_s"] >= FIRST_SLEEP_S * 0.9 and r["ttft_s"] < r["e2e_s"]
        assert r["output_tokens"] == r["max_tokens"]
    tpot = m["tpot_ms"]["p50"]
    assert TOKEN_SLEEP_S * 1000 * 0.9 <= tpot <= TOKEN_SLEEP_S * 1000 * 3, tpot
    assert m["itl_ms"]["p50"] == pytest.approx(tpot, rel=0.5)
    assert m["ttft_ms"]["p50"] <= m["ttft_ms"]["p90"] <= m["ttft_ms"]["p99"]
    assert m["ttft_ms"]["p99"] < m["e2e_ms"]["p99"]
    assert m["output_throughput"] > 0 and m["request_throughput"] > 0
    # the TPOT SLO is below the token sleep: nobody meets it
    assert m["good_requests"] == 0 and m["goodput"] == 0.0 <= m["request_throughput"]
    saved = json.loads(out_json.read_text())
    assert saved["config"]["num_prompts"] == 12 and saved["metrics"]["completed"] == 12
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_goodput_usage_and_chunk_fallback(server):
    base = dict(base_url=server.url, model=MODEL, num_prompts=4, input_len=4, output_len=6, vocab_size=8,
                low_token_id=7, progress=False, timeout_s=30)  # every prompt is [7, 7, 7, 7]: 2 tokens a chunk
    m = run_benchmark(BenchConfig(**base, slo_ttft_ms=10_000, slo_tpot_ms=10_000))["metrics"]
    assert m["total_output_tokens"] == 24  # from usage, not the 12 chunks
    assert m["good_requests"] == 4 and m["goodput"] == pytest.approx(m["request_throughput"])
    # without usage the count falls back to one token per content chunk
    m2 = run_benchmark(BenchConfig(**{**base, "model": NO_USAGE_MODEL}))["metrics"]
    assert m2["completed"] == 4 and m2["usage_reported"] == 0
    assert m2["total_output_tokens"] == 12


def test_failures_and_timeout_are_counted(server):
    m = run_benchmark(BenchConfig(base_url=server.url, model="nope", num_prompts=3, input_len=4, output_len=3,
                                  vocab_size=500, progress=False, timeout_s=10))["metrics"]
    assert m["failed"] == 3 and m["completed"] == 0 and "HTTP 404" in next(iter(m["errors"]))
    t0 = time.monotonic()
    m = run_benchmark(BenchConfig(base_url=server.url, model=MODEL, num_prompts=3, input_len=4, output_len=500,
                                  vocab_size=500, progress=False, timeout_s=0.5))["metrics"]
    assert time.monotonic() - t0 < 5
    assert m["failed"] == 3 and m["completed"] == 0


def test_cli_entry(server, tmp_path, capsys):
    path = tmp_path / "cli.json"
    rc = cli_main(["bench", "--base-url", server.url, "--model", MODEL, "--num-prompts", "3", "--input-len", "5",
                   "--output-len-range", "2,4", "--vocab-size", "500", "--request-rate", "100", "--no-progress",
                   "--result-json", str(path)])
    assert rc == 0
    assert json.loads(path.read_text())["metrics"]["completed"] == 3
    assert "output throughput" in capsys.readouterr().out
    assert cli_main(["bench", "--model", MODEL, "--num-prompts", "0"]) == 2


def test_phases_shift_the_load_and_are_reported_each(server, tmp_path):
    """`--phase`: the workload moves from long prompts with short answers to short prompts with long
    answers; each phase's requests have its lengths, arrive after the previous phase's, and get their
    own figures."""
    from deployments.bench_cli import Phase

    cfg = BenchConfig.from_dict(dict(base_url=server.url, model=MODEL, vocab_size=500, seed=3, timeout_s=30,
                                     progress=False, slo_ttft_ms=10_000, slo_tpot_ms=10_000,
                                     phases=["6,24,2,20", "4,4,8", {"num_prompts": 3, "input_len": 12,
                                                                    "output_len": 3, "request_rate": 10.0}]))
    assert cfg.num_prompts == 13 and cfg.phases[1] == Phase(4, 4, 8)
    reqs, offsets = make_requests(cfg), arrival_offsets(cfg)
    assert [len(r.prompt) for r in reqs] == [24] * 6 + [4] * 4 + [12] * 3
    assert [r.max_tokens for r in reqs] == [2] * 6 + [8] * 4 + [3] * 3
    assert offsets == sorted(offsets) and offsets[6] == offsets[9] > offsets[5]  # phase 2 all at once
    assert offsets[10] > offsets[9]  # and phase 3 one of its own gaps after that burst, not with it
    res = run_benchmark(cfg)
    assert res["metrics"]["completed"] == 13
    phases = res["phases"]
    assert [p["num_requests"] for p in phases] == [6, 4, 3]
    assert [p["total_output_tokens"] for p in phases] == [12, 32, 9]
    assert all(p["completed"] == p["good_requests"] == p["num_requests"] for p in phases)
    # NOTE: arrivals tens of ms apart (seed 3: 0, 82, 332 ms): a loaded host's scheduling jitter (10 ms
    # seen) cannot reorder the phases' first sends.
    assert phases[0]["start_s"] < phases[1]["start_s"] < phases[2]["start_s"]
    for bad in ("6,24", "0,4,4", "6,24,2,-1", "a,b,c"):
        with pytest.raises(ValueError):
            Phase.parse(bad)
    with pytest.raises(ValueError, match="phases set each phase"):
        BenchConfig(base_url="http://x", model=MODEL, phases=(Phase(2, 2, 2),), output_len_range=(1, 3))
