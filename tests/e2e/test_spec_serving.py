"""Speculative decoding through the server (issue 26): greedy streams equal transformers' generate with
speculation on, off, and opted out per request (HTTP and gRPC), disaggregated (ngram) and colocated (suffix); sampled
streams with a seed complete; a speculating sequence moved off a killed decode worker resumes with the
same output; /health, Prometheus and `pdserve bench` report the acceptance of a copying workload."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import json
import time
import uuid
from collections import defaultdict

import grpc
import httpx
import pytest
import ray
import torch
from ray import serve

from deployments.app import NAMESPACE, ROUTER_NAME, build_app, build_grpc_app
from deployments.bench_cli import BenchConfig, run_benchmark
from deployments.config import ServeConfig
from deployments.frontend.grpc import pdserve_pb2, pdserve_pb2_grpc
from deployments.frontend.router_client import RouterBackend
from deployments.frontend.stream_hub import StreamHub
from engine import EngineConfig, LLMEngine, SamplingParams
from helpers import free_port, local_ray, local_serve, pdserve_router, wait_for, wait_no_leaks

MODEL = "SmolLM2-135M-Instruct"
API_KEY = "spec-test-key"
GRPC_METADATA = (("application", "pdserve-grpc"), ("authorization", f"Bearer {API_KEY}"))
MAX_TOKENS = 40
MOVE_MAX_TOKENS = 120
# Copying prompts: the answer repeats text the prompt holds, where prompt lookup and suffix decoding guess.
TEXTS = [
    "The lighthouse stood on a rock at the end of the harbour. Every night the keeper climbed the stairs, "
    "wound the clock that turned the lens, and wrote the weather in a book that nobody ever read.",
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)\n",
    "Bread needs flour, water, salt and yeast. Mix them, let the dough rise for two hours, shape it, "
    "let it rise again, and bake it in a hot oven until the crust is brown and sounds hollow.",
    "Our meeting moved from Tuesday to Thursday at ten. Please bring the budget, the list of open "
    "questions, and the draft of the report so that we can agree on the final version together.",
]


def _chat_ids(tokenizer, text: str) -> list[int]:
    out = tokenizer.apply_chat_template([{"role": "user", "content": f"Repeat this text exactly:\n\n{text}"}],
                                        add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if not isinstance(out, list) else out)


def _hf_greedy(eng: LLMEngine, ids: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy generate on the engine's weights, cut before EOS as the server stops there."""
    with torch.no_grad():
        out = eng.hf_model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                                    attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    gen = out[0, len(ids):].tolist()
    return next((gen[:i] for i, t in enumerate(gen) if t in eng.eos_token_ids), gen)


@pytest.fixture(scope="module")
def model():
    return LLMEngine(EngineConfig(model=None, num_kv_blocks=32, speculative_method="off"))


@pytest.fixture(scope="module")
def reference(model):
    """The copying prompts and transformers' greedy answers to them."""
    prompts = [_chat_ids(model.tokenizer, t) for t in TEXTS]
    return prompts, [_hf_greedy(model, ids, MAX_TOKENS) for ids in prompts], model.tokenizer


def _stream_completion(url: str, body: dict) -> tuple[str, dict]:
    """A streamed /v1/completions: its text and its usage."""
    text, usage = [], {}
    body = {"model": MODEL, "stream": True, "stream_options": {"include_usage": True}, **body}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            chunk = json.loads(line[5:])
            assert "error" not in chunk, chunk
            text += [c["text"] for c in chunk.get("choices") or []]
            usage = chunk.get("usage") or usage
    return "".join(text), usage


def _health_spec(url: str) -> dict[str, dict]:
    h = httpx.get(f"{url}/health", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30).json()
    return {wid: w["speculation"] for wid, w in h["router"]["decode"].items()}


def _drafted(url: str) -> int:
    return sum(s["num_drafted"] for s in _health_spec(url).values() if s)


def _scrape(port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    out: dict[str, float] = defaultdict(float)
    for line in text.splitlines():
        if line.startswith("ray_pdserve_spec_") and 'method="ngram"' in line:
            out[line.split("{", 1)[0].removeprefix("ray_")] += float(line.rsplit(" ", 1)[1])
    return out


@pytest.fixture(scope="class")
def server():
    """1 prefill + 2 decode workers, ngram drafts on every decode step (adaptive off: a fixed draft
    length, so the acceptance checks do not depend on how loaded the machine is)."""
    mport, gport = free_port(), free_port()
    with local_serve(4, grpc_port=gport, _metrics_export_port=mport,
                     _system_config={"metrics_report_interval_ms": 1000}) as port:
        args = {"num_prefill_workers": 1, "num_decode_workers": 2, "kv_cache_memory_mb": 64, "max_num_seqs": 8,
                "speculative_method": "ngram", "speculative_adaptive": False, "api_key": API_KEY,
                "health_check_timeout_s": 5.0}
        serve.run(build_app(args), name="pdserve", route_prefix="/")
        serve.run(build_grpc_app(args), name="pdserve-grpc", route_prefix="/pdserve-grpc")
        yield f"http://127.0.0.1:{port}", ray.get_actor(ROUTER_NAME, namespace=NAMESPACE), mport, gport


@pytest.mark.slow  # its own prefill + decode cluster (~100 s on 2 cores); TestColocated stays in the default run
class TestDisaggregated:
    """Greedy, sampled, opted-out and moved streams, and the reports, with a prefill pool."""

    def test_greedy_streams_equal_transformers_on_and_opted_out(self, server, reference):
        url, router, *_ = server
        prompts, want, tok = reference
        wants = [tok.decode(w, skip_special_tokens=True) for w in want]

        def one(ids, speculative=None):
            body = {"prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0}
            if speculative is not None:
                body["speculative"] = speculative
            return _stream_completion(url, body)[0]

        with cf.ThreadPoolExecutor(len(prompts)) as pool:
            assert list(pool.map(one, prompts)) == wants
        spec = wait_for(lambda: _health_spec(url), lambda s: sum(x["num_accepted"] for x in s.values() if x) > 0,
                        timeout_s=10, what="accepted drafts in /health")
        assert all(s is None or s["method"] == "ngram" for s in spec.values()), spec
        total = {k: sum(s[k] for s in spec.values() if s) for k in ("num_drafted", "num_accepted", "num_emitted")}
        assert total["num_accepted"] / total["num_drafted"] > 0.3, total  # copying: most guesses hold

        before = _drafted(url)  # opted out: same text, not one draft
        assert one(prompts[0], speculative=False) == wants[0]
        time.sleep(0.5)  # the last step's report reaches the router
        assert _drafted(url) == before
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "speculative": "no"},
                       headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "speculative", r.text
        wait_no_leaks(router, timeout_s=30)

    def test_grpc_speculative_field(self, server, reference):
        """gRPC's `speculative`: false never drafts, unset and true draft as the server does; the same
        greedy tokens either way, equal to transformers."""
        url, router, _, gport = server
        prompts, want, tok = reference
        with grpc.insecure_channel(f"127.0.0.1:{gport}") as channel:
            stub = pdserve_pb2_grpc.GenerationStub(channel)

            def one(**speculative) -> tuple[str, list[int]]:
                req = pdserve_pb2.GenerateRequest(prompt_token_ids=prompts[1], max_tokens=MAX_TOKENS, temperature=0,
                                                  **speculative)
                chunks = list(stub.Generate(req, metadata=GRPC_METADATA, timeout=300))
                assert chunks[-1].finish_reason in ("stop", "length"), chunks[-1]
                return "".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids]

            wait_for(lambda: _health_spec(url), lambda s: bool(s), timeout_s=30, what="decode workers in /health")
            before = _drafted(url)
            off = one(speculative=False)
            time.sleep(0.5)  # the last step's report reaches the router
            assert _drafted(url) == before, "a request with speculative=false carried drafts"
            assert off[0] == tok.decode(want[1], skip_special_tokens=True)
            for on in ({}, {"speculative": True}):
                before = _drafted(url)
                assert one(**on) == off
                wait_for(lambda: _drafted(url), lambda d: d > before, timeout_s=10, what=f"drafts with {on}")
        wait_no_leaks(router, timeout_s=30)

    def test_sampled_streams_with_a_seed_complete(self, server, reference):
        url, router, *_ = server
        prompts, _, _ = reference

        def one(i):
            return _stream_completion(url, {"prompt": prompts[i % len(prompts)], "max_tokens": 24, "temperature": 0.8,
                                             "top_p": 0.95, "seed": i, "ignore_eos": True})

        with cf.ThreadPoolExecutor(6) as pool:
            outs = list(pool.map(one, range(6)))
        assert all(u["completion_tokens"] == 24 and text for text, u in outs), outs
        wait_no_leaks(router, timeout_s=30)

    def test_metrics_and_bench_report_acceptance(self, server, reference, tmp_path):
        url, _, mport, _ = server
        prompts, _, _ = reference
        data = tmp_path / "copy.jsonl"
        data.write_text("".join(json.dumps({"prompt": p, "max_tokens": MAX_TOKENS}) + "\n" for p in prompts))
        result = run_benchmark(BenchConfig(base_url=url, model=MODEL, num_prompts=4, dataset=str(data), api_key=API_KEY,
                                           ignore_eos=False, progress=False, timeout_s=300))
        assert result["metrics"]["completed"] == 4
        spec = result["server_speculation"]
        assert spec is not None and spec["method"] == "ngram" and spec["num_accepted"] > 0, spec
        assert spec["mean_accepted_length"] > 1.0 and 0 < spec["acceptance_rate"] <= 1.0, spec
        m = wait_for(lambda: _scrape(mport), lambda m: m.get("pdserve_spec_accepted_tokens_total", 0) > 0,
                     timeout_s=30, interval_s=1.0, what="speculation series exported")
        assert m["pdserve_spec_draft_tokens_total"] >= m["pdserve_spec_accepted_tokens_total"] > 0, m
        assert m["pdserve_spec_emitted_tokens_total"] > m["pdserve_spec_accepted_tokens_total"], m
        assert m["pdserve_spec_acceptance_rate"] > 0 and m["pdserve_spec_mean_accepted_length"] > 1.0, m

    def test_moved_speculating_sequence_resumes_identically(self, server, model):
        url, router, *_ = server
        # Twice the text, so the streams outlast the kill by many steps even when most drafts hold.
        prompts = [_chat_ids(model.tokenizer, f"{t}\n{t}") for t in TEXTS]
        want = [_hf_greedy(model, ids, MOVE_MAX_TOKENS) for ids in prompts]
        backend = RouterBackend(router, StreamHub(), "hub-spec", request_timeout_s=120)
        params = SamplingParams(max_tokens=MOVE_MAX_TOKENS, temperature=0)
        progress = [0] * len(prompts)
        moved_before = ray.get(router.stats.remote())["counters"]["migrations"]

        async def one(i):
            toks = []
            async for d in backend.generate(f"mv{i}-{uuid.uuid4().hex[:6]}", prompts[i], params):
                assert d.finish_reason != "error", d.error
                toks += d.token_ids
                progress[i] = len(toks)
            return toks

        async def go():
            tasks = [asyncio.create_task(one(i)) for i in range(len(prompts))]
            deadline = time.monotonic() + 120
            while min(progress) < 8:  # every stream is decoding (and drafting) before the kill
                assert time.monotonic() < deadline, progress
                await asyncio.sleep(0.02)
            ray.kill((await router.workers.remote())["pdserve-decode-0"])
            return await asyncio.wait_for(asyncio.gather(*tasks), 300)

        assert asyncio.run(go()) == want
        assert ray.get(router.stats.remote())["counters"]["migrations"] > moved_before


@pytest.fixture(scope="class")
def router():
    """No prefill pool: 2 decode workers prefill their own prompts; suffix decoding, adaptive on (as
    `pdserve serve` would run it)."""
    cfg = ServeConfig.from_dict(dict(num_prefill_workers=0, num_decode_workers=2, kv_cache_memory_mb=64,
                                     max_num_seqs=8, speculative_method="suffix"))
    with local_ray(4, namespace="pdserve-spec-colocated"), pdserve_router(cfg, timeout_s=300) as router:
        yield router


class TestColocated:
    """Greedy streams with and without speculation, colocated."""

    def test_greedy_streams_equal_transformers_and_report_speculation(self, router, reference):
        prompts, want, _ = reference
        backend = RouterBackend(router, StreamHub(), "hub-spec-colocated", request_timeout_s=120)

        async def one(i, speculative=True):
            await asyncio.sleep(0.05 * i)  # arrivals spread over steps: later ones join running batches
            params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, speculative=speculative)
            return [t async for d in backend.generate(f"c{i}-{speculative}", prompts[i], params) for t in d.token_ids]

        async def run():
            return await asyncio.gather(*[one(i, s) for s in (True, False) for i in range(len(prompts))])

        got = asyncio.run(run())
        assert got == want + want
        stats = ray.get(router.stats.remote())
        # Every worker that decoded reports its speculation. The router may place all of these
        # prompts on one worker (they share a cached prefix): one that never stepped has no report.
        spec = [d["speculation"] for d in stats["decode"].values() if d["num_steps"]]
        assert spec and all(s is not None and s["method"] == "suffix" for s in spec), stats["decode"]
        wait_no_leaks(router, timeout_s=30)
