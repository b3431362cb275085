"""A request can fail only itself: bounds on what a request carries, and per-row failure in the step."""

from __future__ import annotations

import math

import pytest

from engine import LLM, InvalidRequestError, SamplingParams
from engine.sampling_params import MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(model=tiny_model_dir("llama"), num_kv_blocks=64, block_size=4, max_model_len=200)


@pytest.mark.parametrize("kwargs,field", [
    (dict(temperature=math.nan), "temperature"),
    (dict(temperature=math.inf), "temperature"),
    (dict(temperature=101.0), "temperature"),
    (dict(temperature="0.5"), "temperature"),
    (dict(top_p=math.nan), "top_p"),
    (dict(top_k=True), "top_k"),
    (dict(top_k=1 << 40), "top_k"),
    (dict(seed=1 << 64), "seed"),
    (dict(seed=-(1 << 63) - 1), "seed"),
    (dict(seed=1.5), "seed"),
    (dict(max_tokens=True), "max_tokens"),
    (dict(min_tokens=True), "min_tokens"),
    (dict(ignore_eos="yes"), "ignore_eos"),
    (dict(stop=["x"] * (MAX_STOP_STRINGS + 1)), "stop"),
    (dict(stop=["x" * 513]), "stop"),
    (dict(stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1)), "stop_token_ids"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(stop_token_ids="1"), "stop_token_ids"),
])
def test_out_of_range_values_name_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError) as exc:
        SamplingParams(**kwargs)
    assert exc.value.field == field


def test_the_bounds_themselves_are_accepted():
    SamplingParams(temperature=100.0, seed=(1 << 64) - 1, top_k=1 << 20, stop=["x"] * MAX_STOP_STRINGS)
    SamplingParams(seed=-(1 << 63), stop_token_ids=[0] * MAX_STOP_TOKEN_IDS)


def test_stop_token_ids_outside_the_vocabulary_are_refused_before_queueing(llm):
    eng = llm.engine
    with pytest.raises(InvalidRequestError) as exc:
        eng.add_request("bad-stop", [5, 6], SamplingParams(stop_token_ids=[eng.vocab_size]))
    assert exc.value.field == "stop_token_ids"
    assert not eng.has_unfinished_requests()


def test_a_tiny_temperature_is_greedy_not_an_overflow(llm):
    greedy = llm.generate([[7, 8, 9]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    tiny = llm.generate([[7, 8, 9]], SamplingParams(max_tokens=8, temperature=1e-30, ignore_eos=True, seed=3))[0]
    assert tiny.finish_reason == "length" and tiny.token_ids == greedy.token_ids


def test_a_row_that_fails_in_sampling_ends_only_its_request(llm):
    """The per-row guard itself: one request's sampling is broken behind validation's back (as an
    engine bug or a value validation missed would break it); it ends alone with an error, and the
    requests sharing its steps produce exactly what they produce alone."""
    eng = llm.engine
    prompts = {"a": [11, 12, 13], "b": [14, 15], "c": [16, 17, 18, 19]}
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    alone = {rid: llm.generate([p], greedy)[0].token_ids for rid, p in prompts.items()}
    seeded = SamplingParams(max_tokens=10, temperature=0.8, seed=7, ignore_eos=True)
    seeded_alone = llm.generate([[20, 21]], seeded)[0].token_ids
    for rid, p in prompts.items():
        eng.add_request(rid, p, greedy)
    eng.add_request("seeded", [20, 21], SamplingParams(max_tokens=10, temperature=0.8, seed=7, ignore_eos=True))
    bad = SamplingParams(max_tokens=10, temperature=0.5, ignore_eos=True)
    eng.add_request("poison", [22, 23], bad)
    bad.temperature = math.nan  # behind validation's back: its row turns to NaN
    done = {}
    for _ in range(100):
        if not eng.has_unfinished_requests():
            break
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    assert done["poison"].finish_reason == "error" and "temperature" in done["poison"].error  # names the field
    for rid in prompts:
        assert done[rid].finish_reason == "length" and done[rid].token_ids == alone[rid]
    assert done["seeded"].token_ids == seeded_alone


def test_stop_strings_are_found_on_new_text_only(llm, monkeypatch):
    """The stop check decodes only the newest tokens (plus a little context), not the whole output
    again every token; the text it cuts equals the full decode cut at the stop string."""
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    base = llm.generate([[30, 31, 32]], greedy)[0]
    stop = base.text[-3:]
    decoded: list[int] = []
    real = llm.engine.tokenizer.decode

    def counting(ids, **kw):
        decoded.append(len(ids))
        return real(ids, **kw)

    monkeypatch.setattr(llm.engine.tokenizer, "decode", counting)
    out = llm.generate([[30, 31, 32]], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.text == base.text[: base.text.index(stop)]
    assert max(decoded) <= 4, decoded  # never the whole 40-token output


def test_prefix_cache_keys_are_sha256_and_salted(llm):
    from engine.request import extend_block_keys

    keys = extend_block_keys([], list(range(12)), 3, 4)
    assert len(keys) == 3 and all(isinstance(k, bytes) and len(k) == 32 for k in keys)
    assert extend_block_keys([], list(range(12)), 3, 4, "tenant-a")[0] != keys[0]
    # A block's key depends on everything before it: same tokens after another prefix, another key.
    assert extend_block_keys([], [9, 9, 9, 9] + list(range(4, 8)), 2, 4)[1] != keys[1]

    eng = llm.engine
    prompt = list(range(40, 61))  # 5 full blocks of 4
    sp = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)

    def cached(rid: str, salt: str | None) -> int:
        eng.add_request(rid, prompt, sp, cache_salt=salt)
        outs = []
        while eng.has_unfinished_requests():
            outs += eng.step()
        return next(o for o in outs if o.request_id == rid).num_cached_tokens

    cached("warm-a", "a")
    assert cached("again-a", "a") == 20
    assert cached("other-b", "b") == 0  # another tenant never hits a's entries
    assert cached("unsalted", None) == 0
    with pytest.raises(InvalidRequestError) as exc:
        eng.add_request("bad-salt", prompt, sp, cache_salt="")
    assert exc.value.field == "cache_salt"


def test_dtype_auto_is_bfloat16_on_cuda_and_float32_on_cpu():
    from engine import EngineConfig

    assert EngineConfig().dtype == "float32"
    assert EngineConfig(device="cuda").dtype == "bfloat16"  # nothing loads: no GPU needed
    assert EngineConfig(device="cuda", dtype="float32").dtype == "float32"


def test_the_smallest_top_p_keeps_the_top_token(llm):
    """top_p = 5e-324 is valid (in (0, 1]) but rounds to 0 in fp32: it must sample the top token,
    not fail the request."""
    greedy = llm.generate([[7, 8, 9]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    tiny = llm.generate([[7, 8, 9]], SamplingParams(max_tokens=6, temperature=1.0, top_p=5e-324, seed=1,
                                                     ignore_eos=True))[0]
    assert tiny.finish_reason == "length" and tiny.token_ids == greedy.token_ids
