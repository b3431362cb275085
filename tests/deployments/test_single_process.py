"""The single-process layout (`pdserve serve --layout single`, what `auto` picks on a CPU-only host of at
most 4 cores): the engine and the OpenAI HTTP app in one process, no Ray.

What it must do as the server a user starts: pick itself only where nothing asks for Ray, refuse (exit
2, naming the flag) a Ray-only setting rather than ignore it, answer greedy requests exactly as
transformers' `generate` does, free a disconnected client's blocks, honour max_queued_requests and
request_timeout_s, and stop cleanly on SIGTERM. The API surface itself runs through the same app in
tests/e2e/test_openai_parity.py ("single" there is `build_single_process_app`)."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from deployments.cli import main
from deployments.config import ServeConfig
from deployments.frontend.backend import LocalEngineBackend, QueueFullError
from deployments.layouts import SINGLE_PROCESS_MAX_CPUS, Hardware, local_hardware, ray_only_settings, resolve
from deployments.local_server import single_process_engine_config
from deployments.serve_cli import LaunchOptions, ray_reasons
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.model_loader import resolve_model_dir
from helpers import free_port, served_cli, wait_for

MODEL = "SmolLM2-135M-Instruct"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


# ---------------------------------------------------------------------- the pick
def test_auto_picks_single_on_a_small_cpu_host_only_when_nothing_needs_ray(capsys):
    def picked(settings, hw, launch=LaunchOptions()):
        return resolve(launch.layout, settings, hw, needs_ray=bool(ray_reasons(launch, settings)))[0]

    assert picked({}, Hardware(cpus=2, gpus=0)) == "single"
    assert picked({"max_num_seqs": 64, "api_key": "k", "http_port": 9000}, Hardware(2, 0)) == "single"
    assert picked({"num_threads": 1}, Hardware(2, 0)) == "single"  # the engine's threads, not a layout
    assert picked({"device": "cpu"}, Hardware(cpus=4, gpus=2)) == "single"
    assert picked({}, Hardware(cpus=SINGLE_PROCESS_MAX_CPUS + 1, gpus=0)) == "colocated"
    assert picked({}, Hardware(cpus=2, gpus=1)) == "colocated"
    for ray_setting in ({"num_prefill_workers": 0}, {"num_decode_workers": 2}, {"decode_max_workers": 3},
                        {"direct_ingress": True}, {"client_check_s": 1.0}):
        assert picked(ray_setting, Hardware(2, 0)) != "single", ray_setting
    assert picked({}, Hardware(2, 0), LaunchOptions(grpc_port=9000)) == "colocated"
    assert picked({}, Hardware(2, 0), LaunchOptions(layout="ray")) == "colocated"
    assert picked({}, Hardware(cpus=64, gpus=0), LaunchOptions(layout="single")) == "single"

    layout, settings = resolve("auto", {}, Hardware(cpus=2, gpus=0, cpu_bf16="AMX"))
    cfg = ServeConfig.from_dict(settings)
    assert cfg.engine.num_threads == 2 and cfg.engine.dtype == "bfloat16"
    out = capsys.readouterr().out
    assert "(2 CPU cores, no GPU): single" in out and "--layout disagg" in out
    assert resolve("single", {"num_threads": 1, "dtype": "float32"}, Hardware(2, 0)) == \
        ("single", {"num_threads": 1, "dtype": "float32"})


def test_the_single_engine_prefills_without_a_decode_workers_cap():
    cfg = ServeConfig.from_dict({"num_threads": 2})  # defaults: 1 prefill + 1 decode worker
    assert cfg.engine_config("decode").max_prefill_tokens_per_step == cfg.decode_max_prefill_tokens
    assert single_process_engine_config(cfg).max_prefill_tokens_per_step is None


def test_only_engine_and_front_door_settings_are_single_process_settings():
    assert ray_only_settings({"max_num_seqs": 8, "dtype": "float32", "enable_prefix_caching": True, "api_key": "k",
                              "http_host": "0.0.0.0", "http_port": 1, "model_name": "m", "max_queued_requests": 3,
                              "request_timeout_s": 9.0}) == []
    assert ray_only_settings({"num_prefill_workers": 1, "kv_lease_s": 5.0, "max_num_seqs": 8}) == \
        ["kv_lease_s", "num_prefill_workers"]


@pytest.mark.parametrize("argv, named", [
    (["--prefill-workers", "1"], "--num-prefill-workers"),
    (["--decode-max-workers", "2"], "--decode-max-workers"),
    (["--no-prefix-aware-routing"], "--prefix-aware-routing"),
    (["--grpc-port", "9000", "--http-host", "0.0.0.0"], "--grpc-port"),
])
def test_layout_single_refuses_what_only_ray_does_before_loading_anything(argv, named, capsys):
    assert main(["serve", "--layout", "single", "--port", str(free_port()), *argv]) == 2
    err = capsys.readouterr().err
    assert "--layout single" in err and named in err and "--layout colocated" in err


# ---------------------------------------------------------------------- the backend's limits
@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(model=None, num_threads=2))


def _held(backend: LocalEngineBackend, seconds: float):
    """Keep the engine thread busy for `seconds` (between steps, as a slow step would)."""
    return backend.run_on_engine(lambda _e: time.sleep(seconds))


async def _collect(backend: LocalEngineBackend, rid: str, ids: list[int], n: int):
    return [d async for d in backend.generate(rid, ids, SamplingParams(max_tokens=n, temperature=0.0))]


def test_max_queued_requests_refuses_with_retry_and_keeps_the_queued_one(engine):
    backend = LocalEngineBackend(engine, max_queued_requests=1, retry_after_s=2.0)
    try:
        held = _held(backend, 1.0)

        async def scenario():
            first = asyncio.create_task(_collect(backend, "q-1", [1, 2, 3, 4], 4))
            await asyncio.sleep(0.05)  # q-1 is queued: the engine thread has not taken it yet
            with pytest.raises(QueueFullError, match="max_queued_requests") as exc:
                await _collect(backend, "q-2", [1, 2, 3], 4)
            assert exc.value.retry_after_s == 2.0
            return await asyncio.wait_for(first, 60)

        events = asyncio.run(scenario())
        held.result(10)
        assert events[-1].finished and events[-1].finish_reason == "length"
        assert sum(len(e.token_ids) for e in events) == 4
        assert backend.run_on_engine(lambda e: e.check_integrity() or e.num_running + e.num_waiting).result(10) == 0
    finally:
        backend.shutdown()


def test_request_timeout_ends_a_silent_request_with_an_error_and_frees_it(engine):
    backend = LocalEngineBackend(engine, request_timeout_s=0.3)
    try:
        held = _held(backend, 1.5)
        events = asyncio.run(_collect(backend, "t-1", [5, 6, 7, 8], 8))
        held.result(10)
        assert [e.finish_reason for e in events] == ["error"] and "request_timeout_s" in events[0].error
        wait_for(lambda: backend.run_on_engine(lambda e: e.num_running + e.num_waiting).result(10) == 0,
                 timeout_s=10, what="the timed-out request left the engine")
        assert backend.num_requests == 0
        backend.run_on_engine(lambda e: e.check_integrity()).result(10)
    finally:
        backend.shutdown()


# ---------------------------------------------------------------------- `pdserve serve` itself
@pytest.fixture(scope="module")
def served():
    """`pdserve serve` as a user starts it (fp32, so greedy equals transformers' fp32 generate),
    layout left to `auto` on this host unless it is too large for single (then told)."""
    hw = local_hardware()
    layout = [] if hw.cpus <= SINGLE_PROCESS_MAX_CPUS and not hw.gpus else ["--layout", "single"]
    with served_cli(["--dtype", "float32", "--max-num-seqs", "8", "--kv-cache-memory-mb", "64", *layout],
                    ready_timeout_s=180) as server:
        yield server


@pytest.fixture(scope="module")
def hf():
    return AutoModelForCausalLM.from_pretrained(resolve_model_dir(None, torch.float32), dtype=torch.float32).eval()


def test_serve_says_it_picked_one_process_and_runs_no_ray(served):
    _, proc, lines = served
    if "--layout" not in proc.args:
        assert any("auto picked the fastest layout" in line and ": single;" in line for line in lines), lines
    assert any(line.startswith("pdserve: layout=single  http+engine(1 process") for line in lines), lines
    import psutil

    names = {c.name() for c in psutil.Process(proc.pid).children(recursive=True)}
    assert not any("raylet" in n or "gcs_server" in n for n in names), names


def test_greedy_output_equals_transformers_generate(served, hf):
    url, _, _ = served
    from engine.model_loader import load_tokenizer

    tok = load_tokenizer(None, "float32", None)
    out = tok.apply_chat_template(FRANCE, add_generation_prompt=True, tokenize=True)
    chat_ids = list(out if isinstance(out, list) else out["input_ids"])
    text_ids = tok.encode("The three largest cities of Italy are", add_special_tokens=False)
    with torch.no_grad():
        chat_ref = hf.generate(torch.tensor([chat_ids]), max_new_tokens=16, do_sample=False)[0, len(chat_ids):]
        text_ref = hf.generate(torch.tensor([text_ids]), max_new_tokens=16, min_new_tokens=16,
                               do_sample=False)[0, len(text_ids):]
    chat_ref = chat_ref.tolist()
    if tok.eos_token_id in chat_ref:
        chat_ref = chat_ref[:chat_ref.index(tok.eos_token_id)]
    chat = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": FRANCE, "max_tokens": 16, "temperature": 0}).json()
    assert chat["choices"][0]["message"]["content"] == tok.decode(chat_ref, skip_special_tokens=True)
    done = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": text_ids, "max_tokens": 16, "temperature": 0, "ignore_eos": True}).json()
    assert done["choices"][0]["text"] == tok.decode(text_ref.tolist())
    assert done["usage"] == {"prompt_tokens": len(text_ids), "completion_tokens": 16,
                             "total_tokens": len(text_ids) + 16, "prompt_tokens_details": {"cached_tokens": 0}}


def test_a_client_gone_mid_stream_frees_every_block_and_others_keep_streaming(served):
    url, _, _ = served

    def long_stream(n: int) -> list[str]:
        with httpx.stream("POST", f"{url}/v1/completions", timeout=120, json={
                "model": MODEL, "prompt": "Once upon a time", "max_tokens": n, "stream": True,
                "ignore_eos": True, "temperature": 0}) as r:
            return [line for line in r.iter_lines() if line.startswith("data:")]

    with httpx.stream("POST", f"{url}/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "stream": True,
            "ignore_eos": True}) as r:
        for i, _line in enumerate(r.iter_lines()):
            if i >= 6:
                break  # the client leaves mid-stream
    whole = long_stream(12)
    assert whole[-1] == "data: [DONE]" and len(whole) >= 13

    def health() -> dict:
        return httpx.get(f"{url}/health", timeout=10).json()

    h = wait_for(health, lambda h: h["num_requests"] == 0 and h["num_running"] == 0, timeout_s=30,
                 what="the abandoned request is gone")
    assert h["num_free_blocks"] == h["num_blocks"] and h["status"] == "ok"


def _exposed_series(text: str) -> set[str]:
    """Every pdserve series a Prometheus scrape of `text` declares (`# TYPE` lines; a histogram's
    `_bucket`, `_sum` and `_count`), whether or not it has samples yet."""
    out = set()
    for line in text.splitlines():
        if line.startswith("# TYPE ") and "pdserve_" in line:
            _, _, name, kind = line.split()
            out |= {name + x for x in ("_bucket", "_sum", "_count")} if kind == "histogram" else {name}
    return out


def test_metrics_has_the_ray_layouts_series_behind_the_api_key():
    """The single-process `/metrics` declares exactly the series the Ray layouts export (their set comes
    from deployments/metrics.py's table, with Ray's `ray_` prefix), and asks for the key as /v1 does."""
    from starlette.testclient import TestClient

    from deployments import metrics
    from deployments.frontend.http_app import build_openai_app
    from deployments.local_server import add_metrics_route

    metrics.use_local_registry()
    app = build_openai_app(api_key="sekret")
    add_metrics_route(app)
    client = TestClient(app)
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", headers={"Authorization": "Bearer nope"}).status_code == 401
    r = client.get("/metrics", headers={"Authorization": "Bearer sekret"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    expected = metrics.exported_series()
    assert "ray_pdserve_time_to_first_token_seconds_bucket" in expected and len(expected) > 40
    assert _exposed_series(r.text) == expected


def test_metrics_move_with_a_request(served):
    url, _, _ = served

    def scrape() -> dict[str, float]:
        out: dict[str, float] = {}
        for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
            if line.startswith("ray_pdserve_"):
                name = line.split("{", 1)[0].split(" ", 1)[0]
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return out

    before = scrape()
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": "The sky is", "max_tokens": 5, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200
    after = scrape()
    moved = {k for k, v in after.items() if v > before.get(k, 0.0)}
    for name in ("ray_pdserve_requests_submitted_total", "ray_pdserve_requests_total",
                 "ray_pdserve_generation_tokens_total", "ray_pdserve_prompt_tokens_total",
                 "ray_pdserve_time_to_first_token_seconds_count", "ray_pdserve_e2e_request_latency_seconds_count",
                 "ray_pdserve_step_seconds_count", "ray_pdserve_prefill_tokens_total",
                 "ray_pdserve_decode_tokens_total"):
        assert name in moved, (name, sorted(moved))
    assert after["ray_pdserve_generation_tokens_total"] - before.get("ray_pdserve_generation_tokens_total", 0) == 5
    assert "ray_pdserve_kv_cache_usage" in after and "ray_pdserve_pool_workers" in after


def test_status_prints_the_single_engine(served, capsys):
    url, _, _ = served
    capsys.readouterr()
    assert main(["status", "--url", url]) == 0
    text = capsys.readouterr().out
    assert f"pdserve at {url}" in text and "status ok" in text and "single process" in text
    assert main(["status", "--url", url, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["status"] == "ok" and doc["num_blocks"] > 0
    assert main(["status", "--url", "http://127.0.0.1:1"]) == 1
    assert "cannot reach" in capsys.readouterr().err


def test_sigterm_stops_the_server_cleanly(served):
    url, proc, _ = served
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    rest = proc.stdout.read()
    assert "pdserve: shutting down" in rest
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=5)


def test_a_failed_step_ends_only_the_requests_it_held_and_health_recovers(tiny_model_dir):
    """One step raises while it holds request "a" (max_num_seqs=1: "b" waits): "a" alone ends with a
    generic error (no exception text), "b" then runs to its end, and /health is ok again after."""
    eng = LLMEngine(EngineConfig(model=tiny_model_dir("llama"), max_num_seqs=1, num_threads=1, kv_cache_memory_mb=16))
    real_run, calls = eng.runner.run, []

    def run(sched):
        calls.append([c.request.request_id for c in sched.chunks])
        if calls[-1] == ["a"] and len(calls) == 3:
            raise RuntimeError("secret internal detail")
        return real_run(sched)
    eng.runner.run = run
    backend = LocalEngineBackend(eng)
    try:
        async def scenario():
            a = asyncio.create_task(_collect(backend, "a", [5, 6, 7], 8))
            await asyncio.sleep(0.01)
            b = asyncio.create_task(_collect(backend, "b", [8, 9, 10], 8))
            return await asyncio.wait_for(a, 60), await asyncio.wait_for(b, 60)

        events_a, events_b = asyncio.run(scenario())
        assert events_a[-1].finish_reason == "error" and "RuntimeError" in events_a[-1].error
        assert "secret" not in events_a[-1].error
        assert events_b[-1].finish_reason == "length" and sum(len(e.token_ids) for e in events_b) == 8
        health = asyncio.run(backend.health())
        assert health["status"] == "ok" and health["last_error"] is None, health
        assert backend.run_on_engine(lambda e: e.check_integrity() or e.num_running + e.num_waiting).result(10) == 0
    finally:
        backend.shutdown()
