"""Priority is the operator's choice (`scheduling_policy`): under "fcfs" (the default) a non-zero
`priority` is refused, never accepted and ignored: by the engine (`InvalidRequestError("priority")`)
and at both doors (400 / INVALID_ARGUMENT naming `priority`, the one preparation they share); under
"priority" it orders the queue (lower first). No Ray: a tiny random-weight model in process."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import httpx
import pytest
from helpers import ThreadedServer

from deployments.config import ServeConfig
from deployments.frontend.backend import LocalEngineBackend
from deployments.frontend.grpc import pdserve_pb2
from deployments.frontend.grpc_app import GenerationService, GRPCError, ServingState
from deployments.frontend.http_app import build_openai_app
from deployments.frontend.prepare import PromptInput, PromptKind, SamplingInput, ServedModel, prepare
from engine import EngineConfig, InvalidRequestError, LLMEngine, SamplingParams
from engine.errors import EngineConfigError


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine(EngineConfig(model=tiny_model_dir("llama"), num_threads=1, kv_cache_memory_mb=16))


def test_the_setting_defaults_to_fcfs_and_takes_only_its_two_values(tiny_model_dir):
    assert EngineConfig().scheduling_policy == "fcfs"
    assert ServeConfig.from_dict({"scheduling_policy": "priority"}).engine.scheduling_policy == "priority"
    with pytest.raises(EngineConfigError, match="scheduling_policy"):
        EngineConfig(scheduling_policy="lifo")


def test_under_fcfs_the_engine_refuses_a_priority(engine):
    sp = SamplingParams(max_tokens=1)
    for bad in (1, -5, True):
        with pytest.raises(InvalidRequestError) as e:
            engine.add_request("p", [3, 4], sp, priority=bad)
        assert e.value.field == "priority"
    engine.add_request("zero", [3, 4], sp, priority=0)  # the default is fine
    assert engine.abort("zero") and not engine.has_unfinished_requests()


def test_under_priority_the_lower_one_runs_first(tiny_model_dir):
    eng = LLMEngine(EngineConfig(model=tiny_model_dir("llama"), num_kv_blocks=64, block_size=4, max_num_seqs=1,
                                 scheduling_policy="priority"))
    sp = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    eng.add_request("later", [3, 4], sp, priority=2)
    eng.add_request("sooner", [3, 4], sp, priority=-2)
    order = []
    while eng.has_unfinished_requests():
        order += [o.request_id for o in eng.step() if o.finished]
    assert order == ["sooner", "later"]


def test_preparation_refuses_a_priority_under_fcfs_and_carries_it_under_priority(engine):
    fcfs = ServedModel.of("m", engine.tokenizer, engine.max_model_len)
    prompt = PromptInput(PromptKind.TEXT, "hi")
    with pytest.raises(InvalidRequestError) as e:
        prepare(fcfs, prompt, SamplingInput(), priority=1)
    assert e.value.field == "priority" and "scheduling_policy" in e.value.message
    assert prepare(fcfs, prompt, SamplingInput(), priority=0).priority == 0
    prio = dataclasses.replace(fcfs, scheduling_policy="priority")
    assert prepare(prio, prompt, SamplingInput(), priority=-7).priority == -7
    with pytest.raises(InvalidRequestError):  # still bounded under "priority"
        prepare(prio, prompt, SamplingInput(), priority=2**31)


class _Ctx:
    code = None

    def invocation_metadata(self):
        return []

    def set_code(self, code):
        self.code = code

    def set_details(self, details):
        pass


def test_both_doors_answer_a_priority_under_fcfs_with_an_error_naming_it(engine):
    backend = LocalEngineBackend(engine)
    try:
        app = build_openai_app(backend, engine.tokenizer, "m", engine.max_model_len, vocab_size=engine.vocab_size)
        with ThreadedServer(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
            r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "priority": 3})
            assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text
            r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "priority": 0})
            assert r.status_code == 200, r.text
        service = GenerationService(ServingState(backend, engine.tokenizer, "m", engine.max_model_len,
                                                 engine.vocab_size))

        async def run():
            return [o async for o in service.Generate(pdserve_pb2.GenerateRequest(prompt="hi", priority=3), _Ctx())]

        with pytest.raises(GRPCError) as e:
            asyncio.run(run())
        assert e.value.code is grpc.StatusCode.INVALID_ARGUMENT and e.value.message.startswith("priority")
    finally:
        backend.shutdown()
