"""Engine behaviour on the tiny model: bad input, abort, sampling, batching policies, the offline API.

The tests on the shared `llm` (and the batching policies' greedy outputs) run on every device in
`device_params.DEVICES`; the scheduling-only ones on the CPU.
"""

from __future__ import annotations

import pytest

from device_params import DEVICES, EXACT_DTYPE
from engine import LLM, EngineConfig, InvalidRequestError, LLMEngine, PromptTooLongError, SamplingParams
from engine.errors import EngineConfigError
from engine.kv_lending import KVLending


@pytest.fixture(scope="module", params=DEVICES)
def llm(tiny_model_dir, request):
    return LLM(model=tiny_model_dir("llama"), device=request.param, dtype=EXACT_DTYPE, num_kv_blocks=64, block_size=4,
               max_model_len=200)


@pytest.mark.parametrize("kwargs,field", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(temperature=-0.1), "temperature"),
    (dict(stop=[3]), "stop"),
    (dict(stop=5), "stop"),
    (dict(top_k=-2), "top_k"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError) as exc:
        SamplingParams(**kwargs)
    assert exc.value.field == field
    assert isinstance(exc.value, ValueError)


def test_bad_prompts_rejected_and_engine_keeps_serving(llm):
    eng = llm.engine
    eng.add_request("good", [5, 6, 7], SamplingParams(max_tokens=5, temperature=0))
    with pytest.raises(InvalidRequestError) as e1:
        eng.add_request("empty", "", SamplingParams())
    assert e1.value.field == "prompt"
    with pytest.raises(InvalidRequestError):
        eng.add_request("empty2", [], SamplingParams())
    with pytest.raises(PromptTooLongError) as e2:
        eng.add_request("long", [5] * 500, SamplingParams())
    assert e2.value.field == "prompt"
    with pytest.raises(InvalidRequestError):
        eng.add_request("vocab", [10**9], SamplingParams())
    with pytest.raises(InvalidRequestError) as e3:
        eng.add_request("good", [1, 2], SamplingParams())
    assert e3.value.field == "request_id"
    with pytest.raises(InvalidRequestError):
        llm.generate(["fine prompt", ""], SamplingParams(max_tokens=3))
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    assert list(done) == ["good"] and len(done["good"].token_ids) == 5


def test_bad_engine_config():
    with pytest.raises(EngineConfigError, match="static, dynamic, continuous"):
        EngineConfig(batching="weird")
    with pytest.raises(EngineConfigError, match="block_size"):
        EngineConfig(block_size=0)
    with pytest.raises(EngineConfigError, match="max_prefill_tokens_per_step"):
        EngineConfig(max_prefill_tokens_per_step=0)


def test_abort_mid_generation_frees_blocks(llm):
    eng = llm.engine
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    eng.add_request("a", list(range(10, 40)), params)
    eng.add_request("b", list(range(50, 60)), params)
    for _ in range(5):
        eng.step()
    assert eng.block_manager.num_used_blocks > 0
    assert eng.abort("a")
    assert not eng.abort("nope")
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert all(o.request_id == "b" for o in outs)
    assert eng.block_manager.num_used_blocks == 0


def test_pinned_blocks_copied_into_another_engines_prefix_cache(llm, tiny_model_dir):
    """The KV backup hooks: pin a running request's computed prompt blocks (they outlive it), copy them
    into a second engine and `cache_blocks` them there: that engine then takes them as a cached prefix
    and samples what the first one did."""
    eng = llm.engine
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompt = list(range(100, 123))  # 5 full blocks of 4, and 3 tokens
    eng.add_request("a", prompt, params)
    eng.step()  # the whole prompt in one step
    pinned = KVLending(eng).pin_computed_blocks("a", len(prompt))
    assert len(pinned) == 5 and KVLending(eng).pin_computed_blocks("nope", 10) == []
    out = []
    while eng.has_unfinished_requests():
        out += [o for o in eng.step() if o.finished]
    assert eng.block_manager.num_used_blocks == 5  # "a" ended, its pinned blocks did not

    other = LLMEngine(EngineConfig(model=tiny_model_dir("llama"), device=eng.config.device, dtype=EXACT_DTYPE,
                                   num_kv_blocks=64, block_size=4, max_model_len=200))
    ids = KVLending(other).allocate_blocks(3 * 4)  # blocks 2..4: the other engine has 0..1 from a shared prefix
    other.runner.kv_cache[ids] = eng.runner.kv_cache[pinned[2:]]
    KVLending(eng).free_blocks(pinned)
    other.add_request("head", prompt[:9], SamplingParams(max_tokens=1))
    while other.has_unfinished_requests():
        other.step()
    assert KVLending(other).cache_blocks(prompt[:20], ids, first_block=2) == 3
    assert other.block_manager.num_used_blocks == 0  # cached and free
    other.add_request("b", prompt + out[0].token_ids[:2], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    got = []
    while other.has_unfinished_requests():
        got += [o for o in other.step() if o.finished]
    assert got[0].num_cached_tokens == 20 and got[0].token_ids == out[0].token_ids[2:]
    other.check_integrity()
    assert other.block_manager.num_used_blocks == 0


def test_take_cached_blocks_leases_the_cached_prefix(llm):
    """What a prefill worker exports to a decode worker fetching a prefix: a reference on each cached
    block of the longest cached prefix (revived from the free queue), none past `max_tokens`."""
    eng = llm.engine
    bm = eng.block_manager
    prompt = list(range(130, 149))  # 4 full blocks of 4, and 3 tokens
    llm.generate([prompt], SamplingParams(max_tokens=1))
    assert bm.num_used_blocks == 0
    assert KVLending(eng).take_cached_blocks([1, 2, 3, 4, 5]) == []  # nothing cached
    got = KVLending(eng).take_cached_blocks(prompt + [7, 7, 7, 7], max_tokens=14)
    assert len(got) == 3 and bm.num_used_blocks == 3  # 14 tokens: 3 full blocks, now in use
    whole = KVLending(eng).take_cached_blocks(prompt)
    assert whole[:3] == got and len(whole) == 4 and bm.num_used_blocks == 4  # a second reference on 3
    KVLending(eng).free_blocks(got)
    KVLending(eng).free_blocks(whole)
    assert bm.num_used_blocks == 0 and bm.num_cached_blocks >= 4  # still cached after the lease
    eng.add_request("again", prompt, SamplingParams(max_tokens=1))
    while eng.has_unfinished_requests():
        outs = eng.step()
    assert outs[0].num_cached_tokens == 16


def test_step_enters_forward_only_around_the_model(llm):
    """A worker's `forward` context sees the step scheduled (blocks allocated) and not yet postprocessed."""
    eng = llm.engine
    seen = []

    class Probe:
        def __enter__(self):
            seen.append((eng.block_manager.num_used_blocks, eng.scheduler.running[0].num_computed_tokens))

        def __exit__(self, *exc):
            return False

    eng.add_request("p", list(range(40, 49)), SamplingParams(max_tokens=1))
    outs = eng.step(forward=Probe())
    assert seen == [(3, 0)] and outs[0].finished


def test_urgent_recompute_is_not_held_to_the_prefill_cap(tiny_model_dir):
    """`max_prefill_tokens_per_step` keeps a decode worker's batch streaming, but a recompute whose
    client is stalled (urgent) runs whole within the token budget; new prompts still keep to the cap."""
    eng = LLMEngine(EngineConfig(model=tiny_model_dir("llama"), num_kv_blocks=64, block_size=4, max_model_len=200,
                                 max_prefill_tokens_per_step=8))
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    eng.add_request("moved", list(range(30, 50)), params, urgent=True)
    eng.step()
    assert eng.last_step.num_prefill_tokens == 20
    eng.add_request("new", list(range(60, 80)), params)
    eng.step()
    assert eng.last_step.num_prefill_tokens == 8
    while eng.has_unfinished_requests():
        eng.step()
    eng.check_integrity()
    assert eng.block_manager.num_used_blocks == 0


def test_urgent_prompt_gets_a_step_without_newer_prompts(llm):
    """A recompute (`urgent`) admitted in a step stops that step from filling up with newer prompts;
    they run in the next step, and greedy output does not change."""
    eng = llm.engine
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    alone = llm.generate([list(range(30, 50))], params)[0].token_ids
    eng.add_request("new1", list(range(60, 70)), params)
    eng.add_request("new2", list(range(70, 80)), params)
    eng.add_request("moved", list(range(30, 50)), params, arrival_time=0.0, urgent=True)  # arrived first
    outs = eng.step()
    assert [o.request_id for o in outs] == ["moved"] and eng.last_step.num_seqs == 1
    outs = eng.step()
    assert sorted(o.request_id for o in outs) == ["moved", "new1", "new2"]
    done = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
    assert done["moved"] == alone


def test_seeded_sampling_reproducible_whatever_the_batch(llm):
    sp = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = llm.generate([[9, 8, 7, 6]], sp)[0].token_ids
    others = [SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True) for _ in range(5)]
    batch = llm.generate([[1, 2, 3], [9, 8, 7, 6], [4] * 30, [11, 12], [13] * 7, [14]], [others[0], sp, *others[1:]])
    assert batch[1].token_ids == alone
    differently_seeded = llm.generate([[9, 8, 7, 6]], SamplingParams(max_tokens=12, temperature=0.9, seed=99, ignore_eos=True))
    assert differently_seeded[0].token_ids != alone


def test_stop_tokens_max_tokens_ignore_eos_min_tokens(llm):
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    base = llm.generate([[5, 6, 7]], greedy)[0]
    assert len(base.token_ids) == 10 and base.finish_reason == "length"
    stop_tok = base.token_ids[4]
    first = base.token_ids.index(stop_tok)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop_tok]))[0]
    assert out.token_ids == base.token_ids[:first] and out.finish_reason == "stop"
    # min_tokens bans the stop token until enough tokens exist.
    out2 = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop_tok],
                                                    min_tokens=first + 1))[0]
    assert len(out2.token_ids) > first


def test_stop_string_cuts_text(llm):
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    base = llm.generate([[20, 21, 22]], greedy)[0]
    text = base.text
    assert len(text) > 4
    stop = text[len(text) // 2: len(text) // 2 + 2]
    out = llm.generate([[20, 21, 22]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[: text.index(stop)]


def test_text_and_token_prompts_agree(llm):
    sp = SamplingParams(max_tokens=6, temperature=0)
    ids = llm.tokenizer.encode("hello there", add_special_tokens=False)
    a, b = llm.generate(["hello there", ids], sp)
    assert a.token_ids == b.token_ids


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("policy", ["static", "dynamic", "continuous"])
def test_batching_policies_same_greedy_output(tiny_model_dir, policy, device):
    eng_llm = LLM(model=tiny_model_dir("llama"), device=device, dtype=EXACT_DTYPE, num_kv_blocks=128, block_size=4,
                  batching=policy, max_num_seqs=3, max_wait_s=0.0)
    prompts = [[i + 3] * (i + 2) for i in range(7)]
    sp = [SamplingParams(max_tokens=4 + 3 * i, temperature=0, ignore_eos=True) for i in range(7)]
    outs = eng_llm.generate(prompts, sp)
    ref = LLM(model=tiny_model_dir("llama"), device=device, dtype=EXACT_DTYPE, num_kv_blocks=128, block_size=4,
              max_num_seqs=1).generate(prompts, sp)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    eng_llm.engine.check_integrity()


def test_static_batch_runs_to_completion_before_admitting(tiny_model_dir):
    eng = LLMEngine(EngineConfig(model=tiny_model_dir("llama"), num_kv_blocks=128, block_size=4, batching="static",
                                 max_num_seqs=2))
    sp_long = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    sp_short = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    eng.add_request("long", [3, 4, 5], sp_long)
    eng.step()
    assert eng.last_step.num_seqs == 0  # a static batch waits until it is full
    eng.add_request("short", [6, 7], sp_short)
    eng.add_request("late", [8, 9], sp_short)
    eng.scheduler.draining = True  # no more arrivals: the last, partial batch may start
    finished_order = []
    saw_late_with_long = False
    while eng.has_unfinished_requests():
        running = {r.request_id for r in eng.scheduler.running}
        saw_late_with_long |= {"late", "long"} <= running
        finished_order += [o.request_id for o in eng.step() if o.finished]
    assert not saw_late_with_long
    assert finished_order == ["short", "long", "late"]


def test_dynamic_batch_starts_after_max_wait(tiny_model_dir):
    import time

    eng = LLMEngine(EngineConfig(model=tiny_model_dir("llama"), num_kv_blocks=64, block_size=4, batching="dynamic",
                                 max_num_seqs=8, max_wait_s=0.05))
    eng.add_request("x", [3, 4], SamplingParams(max_tokens=2, temperature=0))
    assert eng.step() == []
    time.sleep(0.06)
    eng.step()
    assert eng.last_step.num_seqs == 1


def test_priority_runs_first(tiny_model_dir):
    eng = LLMEngine(EngineConfig(model=tiny_model_dir("llama"), num_kv_blocks=64, block_size=4, max_num_seqs=1,
                                 scheduling_policy="priority"))
    sp = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    eng.add_request("low", [3, 4], sp, priority=5)
    eng.add_request("high", [3, 4], sp, priority=-1)
    order = []
    while eng.has_unfinished_requests():
        order += [o.request_id for o in eng.step() if o.finished]
    assert order == ["high", "low"]


def test_earlier_arrival_runs_first_within_a_priority(tiny_model_dir):
    """A request resumed after its worker died carries its first arrival: it goes ahead of newer ones."""
    import time

    eng = LLMEngine(EngineConfig(model=tiny_model_dir("llama"), num_kv_blocks=64, block_size=4, max_num_seqs=1,
                                 scheduling_policy="priority"))
    sp = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    eng.add_request("new", [3, 4], sp)
    eng.add_request("resumed", [3, 4, 5], sp, arrival_time=time.monotonic() - 10.0)
    eng.add_request("urgent", [3, 4], sp, priority=-1)
    order = []
    while eng.has_unfinished_requests():
        order += [o.request_id for o in eng.step() if o.finished]
    assert order == ["urgent", "resumed", "new"]
    eng.check_integrity()


def test_default_model_chat_answers_paris():
    llm = LLM(num_kv_blocks=64)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}], SamplingParams(max_tokens=20, temperature=0))[0]
    assert "Paris" in out.text
    llm.engine.check_integrity()
