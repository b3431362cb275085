"""Structured outputs (xgrammar): every output of a constrained request matches its grammar at any
temperature, bad specs are refused naming their field, compiled grammars are cached, a resumed request
continues its grammar, constrained requests never speculate, and a failing matcher fails its request alone."""

from __future__ import annotations

import json
import re
import threading
import time
from unittest import mock

import jsonschema
import pytest

from engine import LLM, InvalidRequestError, LLMEngine, SamplingParams
from engine.errors import parse_invalid_request
from engine.structured import GrammarCache, GrammarState, StructuredSpec, compile_error_text
from engine.kv_lending import KVLending

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tag": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "ok", "tag"],
    "additionalProperties": False,
}
PROMPTS = [[5, 6, 7], [100, 200, 300, 400], [9] * 7, [4000, 31, 2]]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(model=tiny_model_dir("llama"), dtype="float32", num_kv_blocks=256, block_size=4, max_model_len=300)


def _run(llm, spec: StructuredSpec, temperature: float, max_tokens: int = 160):
    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=s, structured=spec)
              for s in range(len(PROMPTS))]
    outs = llm.generate(PROMPTS, params)
    assert all(o.finish_reason == "stop" for o in outs), [(o.finish_reason, o.text, o.error) for o in outs]
    return [o.text for o in outs]


@pytest.mark.parametrize("temperature", [0.0, 1.0, 2.0])
def test_json_schema_outputs_validate(llm, temperature):
    for text in _run(llm, StructuredSpec("json_schema", json.dumps(SCHEMA)), temperature):
        jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("temperature", [0.0, 2.0])
def test_json_object_regex_choice_and_grammar(llm, temperature):
    spec = StructuredSpec("json_object")
    params = [SamplingParams(max_tokens=120, temperature=temperature, seed=s, structured=spec) for s in range(4)]
    for o in llm.generate(PROMPTS, params):  # free-form JSON may run to max_tokens; whatever ends is JSON
        if o.finish_reason == "stop":
            assert isinstance(json.loads(o.text), dict)
    pattern = r"[a-c]{2,5}-[0-9]{3}"
    assert all(re.fullmatch(pattern, t) for t in _run(llm, StructuredSpec("regex", pattern), temperature))
    choices = ["yes", "no", 'say "maybe"\n']
    texts = _run(llm, StructuredSpec("choice", json.dumps(choices)), temperature)
    assert all(t in choices for t in texts)
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    assert all(re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", t)
               for t in _run(llm, StructuredSpec("grammar", grammar), temperature, max_tokens=200))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_yields_to_a_complete_grammar(llm, temperature):
    """min_tokens bans the stop tokens; a grammar that allows nothing but its end still ends ("stop", no
    error), and one that allows more keeps going until min_tokens or its own end."""
    short = [SamplingParams(max_tokens=20, min_tokens=8, temperature=temperature, seed=s,
                            structured=StructuredSpec("choice", json.dumps(["yes", "no"]))) for s in range(4)]
    outs = llm.generate(PROMPTS, short)
    assert all(o.finish_reason == "stop" and o.text in ("yes", "no") for o in outs), [(o.text, o.error) for o in outs]
    longer = [SamplingParams(max_tokens=30, min_tokens=6, temperature=temperature, seed=s,
                             structured=StructuredSpec("regex", "[0-9]{1,12}")) for s in range(4)]
    for o in llm.generate(PROMPTS, longer):
        assert o.finish_reason == "stop" and re.fullmatch("[0-9]{1,12}", o.text), (o.text, o.error)
        assert len(o.token_ids) >= 6 or len(o.text) == 12, o.text


@pytest.mark.parametrize("spec,field", [
    (StructuredSpec("json_schema", "{not json"), "response_format"),
    (StructuredSpec("json_schema", json.dumps({"type": 5})), "response_format"),
    (StructuredSpec("regex", "(((ab"), "guided_regex"),
    (StructuredSpec("choice", "[]"), "guided_choice"),
    (StructuredSpec("choice", '["a", 3]'), "guided_choice"),
    (StructuredSpec("grammar", 'root ::= "a" |'), "guided_grammar"),
    (StructuredSpec("grammar", 'start ::= "a"'), "guided_grammar"),
])
def test_bad_specs_are_refused_naming_the_field(llm, spec, field):
    """A spec that does not compile ends its request alone, with an error naming the field (compiled off
    the step loop: the refusal comes with a step's outputs); the same spec again is refused at once."""
    eng = llm.engine
    eng.add_request("bad", [5, 6], SamplingParams(structured=spec))
    outs = []
    for _ in range(10_000):
        outs += [o for o in eng.step() if o.request_id == "bad"]
        if outs or not eng.has_unfinished_requests():
            break
        time.sleep(0.001)
    assert len(outs) == 1 and outs[0].finish_reason == "error", outs
    refused = parse_invalid_request(outs[0].error)
    assert refused is not None and refused.field == field and ".cc:" not in outs[0].error
    assert not eng.has_unfinished_requests()
    with pytest.raises(InvalidRequestError) as exc:  # remembered: refused before anything is queued
        eng.add_request("bad", [5, 6], SamplingParams(structured=spec))
    assert exc.value.field == field and not eng.has_unfinished_requests()
    with pytest.raises(InvalidRequestError):
        StructuredSpec("yaml", "")
    assert llm.generate([[5, 6]], SamplingParams(max_tokens=2))[0].finish_reason == "length"  # still serving


def test_compiled_grammars_are_cached_lru_within_a_byte_budget(llm):
    probe = GrammarCache(llm.tokenizer, llm.engine.vocab_size, [llm.tokenizer.eos_token_id])
    a, b, c = (StructuredSpec("regex", p) for p in ("a+", "b+", "c+"))
    sizes = [probe.compile(s).memory_size_bytes for s in (a, b, c)]
    assert min(sizes) > 0 and probe.num_bytes == sum(sizes)
    size = sizes[0]
    budget = sum(sizes) - 1  # any two fit, not all three
    cache = GrammarCache(llm.tokenizer, llm.engine.vocab_size, [llm.tokenizer.eos_token_id], max_bytes=budget)
    assert cache.compile(a) is cache.compile(a) and cache.num_compiled == 1
    cache.compile(b)
    cache.compile(a)  # a is now the most recent: c evicts b
    cache.compile(c)
    cache.compile(a)
    assert cache.num_compiled == 3 and cache.num_bytes <= budget
    cache.compile(b)
    assert cache.num_compiled == 4
    tiny = GrammarCache(llm.tokenizer, llm.engine.vocab_size, [llm.tokenizer.eos_token_id], max_bytes=size // 2)
    tiny.compile(a)
    tiny.compile(a)  # larger than the whole budget: never kept
    assert tiny.num_compiled == 2 and tiny.num_bytes == 0


class _SlowCompiles:
    """Grammar compiles that wait for `release()` (an injected slow compiler): what a test of "the
    engine keeps stepping meanwhile" needs without depending on how fast a real compile is."""

    def __init__(self):
        self.gate = threading.Event()
        self.started = threading.Semaphore(0)
        self._real = GrammarCache._compile

    def __enter__(self):
        slow = self

        def compile_slowly(cache, spec):
            slow.started.release()
            assert slow.gate.wait(60), "the test never released the compile"
            return slow._real(cache, spec)
        self._patch = mock.patch.object(GrammarCache, "_compile", compile_slowly)
        self._patch.__enter__()
        return self

    def __exit__(self, *exc):
        self.gate.set()
        self._patch.__exit__(*exc)


def test_the_engine_keeps_stepping_while_a_grammar_compiles(llm):
    """A request whose grammar is compiling waits in its own state, holding no step: the others are
    scheduled and produce tokens every step meanwhile; once compiled, it runs and matches its grammar."""
    eng = llm.engine
    spec = StructuredSpec("regex", "[a-c]{3}-[0-9]{2}")
    with _SlowCompiles() as slow:
        eng.add_request("slow", PROMPTS[0], SamplingParams(max_tokens=20, temperature=0, structured=spec))
        assert slow.started.acquire(timeout=30)  # the compile is running on its worker
        eng.add_request("plain", PROMPTS[1], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        plain_tokens = 0
        for _ in range(12):
            outs = eng.step()
            assert [o.request_id for o in outs] == ["plain"] and eng.num_awaiting_grammar == 1
            plain_tokens += len(outs[0].new_token_ids)
        assert plain_tokens == 12 and not eng.grammars.cached(spec)  # every step made a token; still compiling
        slow.gate.set()
        done = None
        for _ in range(10_000):
            done = next((o for o in eng.step() if o.request_id == "slow" and o.finished), done)
            if done is not None:
                break
            time.sleep(0.001)
    assert done.finish_reason == "stop" and re.fullmatch("[a-c]{3}-[0-9]{2}", done.text), done
    assert eng.num_awaiting_grammar == 0


def test_a_compile_past_its_budget_fails_its_request_alone_and_abort_cancels(llm):
    eng = llm.engine
    spec = StructuredSpec("regex", "[x-z]{4}")
    eng.grammars.timeout_s, budget = 0.2, eng.grammars.timeout_s
    try:
        with _SlowCompiles():
            eng.add_request("late", PROMPTS[0], SamplingParams(max_tokens=8, structured=spec))
            eng.add_request("plain", PROMPTS[1], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
            late, plain = None, []
            for _ in range(100_000):  # the plain request steps on meanwhile; its budget ends the late one
                outs = eng.step()
                plain += [o for o in outs if o.request_id == "plain"]
                late = next((o for o in outs if o.request_id == "late"), None)
                if late is not None:
                    break
                time.sleep(0.001)
            refused = parse_invalid_request(late.error)
            assert late.finish_reason == "error" and refused.field == "guided_regex" and "budget" in refused.message
            # The plain request alone was not touched: it made tokens, and no error (on a fast host it may
            # have finished before the budget ran out).
            assert plain and all(o.finish_reason in (None, "length") for o in plain)
            if not plain[-1].finished:
                assert eng.abort("plain")
            assert not eng.has_unfinished_requests()
            # A queued compile whose only waiter leaves is cancelled: the pool's workers are taken.
            other = [StructuredSpec("regex", f"q{i}+") for i in range(eng.config.grammar_compile_workers + 1)]
            for i, s in enumerate(other):
                eng.add_request(f"w{i}", PROMPTS[0], SamplingParams(max_tokens=4, structured=s))
            queued = eng._awaiting_grammar[f"w{len(other) - 1}"].job
            assert eng.abort(f"w{len(other) - 1}") and queued.future.cancelled()
            for i in range(len(other) - 1):
                assert eng.abort(f"w{i}")
            assert not eng.has_unfinished_requests()
        for _ in range(6000):  # its compile, left running with nobody waiting, ends once released
            if eng.grammars.num_running == 0:
                break
            time.sleep(0.005)
        with pytest.raises(InvalidRequestError) as exc:  # ...and the slow spec is remembered as too slow
            eng.add_request("again", PROMPTS[0], SamplingParams(max_tokens=8, structured=spec))
        assert "budget" in exc.value.message and not eng.has_unfinished_requests()
    finally:
        eng.grammars.timeout_s = budget


def _step_until_done(eng, request_id: str):
    for _ in range(10_000):
        done = next((o for o in eng.step() if o.request_id == request_id and o.finished), None)
        if done is not None:
            return done
        time.sleep(0.001)
    raise AssertionError(f"{request_id} never finished")


def test_each_structured_requests_grammar_wait_is_noted_for_its_trace(llm):
    """engine/grammar_waits.py: with a log attached, each structured request's wait for its grammar is
    noted once it ends: a compile (how long it queued and ran), a cache hit, a spec that does not
    compile, the same spec refused at once, and an abort while compiling. Unstructured requests and an
    engine without a log note nothing."""
    eng = llm.engine
    assert eng.grammar_waits is None
    log = eng.watch_grammar_waits()
    try:
        spec = StructuredSpec("regex", "[d-f]{2}-[0-9]")
        t0 = time.time()
        eng.add_request("miss", PROMPTS[0], SamplingParams(max_tokens=8, temperature=0, structured=spec))
        eng.add_request("plain", PROMPTS[1], SamplingParams(max_tokens=2, temperature=0))
        assert _step_until_done(eng, "miss").finish_reason == "stop"
        while eng.has_unfinished_requests():
            eng.step()
        eng.add_request("hit", PROMPTS[2], SamplingParams(max_tokens=8, temperature=0, structured=spec))
        assert _step_until_done(eng, "hit").finish_reason == "stop"
        miss, hit = log.take()
        assert miss.request_id == "miss" and miss.kind == "regex" and not miss.cache_hit
        assert miss.error_cause is None and miss.error is None
        assert miss.compile_s > 0 and miss.queue_s >= 0
        assert t0 <= miss.start_time <= miss.end_time <= time.time()
        assert miss.end_time - miss.start_time >= miss.compile_s  # it waited at least the compile
        assert hit.request_id == "hit" and hit.cache_hit and hit.compile_s is None and hit.error_cause is None

        bad = StructuredSpec("grammar", 'root ::= "waits" |')  # not used by another test: not remembered yet
        eng.add_request("bad", [5, 6], SamplingParams(structured=bad))
        assert _step_until_done(eng, "bad").finish_reason == "error"
        with pytest.raises(InvalidRequestError):
            eng.add_request("bad-again", [5, 6], SamplingParams(structured=bad))
        with _SlowCompiles() as slow:
            eng.add_request("gone", PROMPTS[0], SamplingParams(max_tokens=4, structured=StructuredSpec("regex", "g+")))
            assert slow.started.acquire(timeout=30)
            assert eng.abort("gone")
        failed, again, gone = log.take()
        assert (failed.request_id, failed.error_cause, failed.cache_hit) == ("bad", "invalid", False)
        assert parse_invalid_request(failed.error).field == "guided_grammar" and failed.compile_s is not None
        assert (again.request_id, again.error_cause, again.cache_hit) == ("bad-again", "known_invalid", True)
        assert parse_invalid_request(again.error).field == "guided_grammar"
        assert (gone.request_id, gone.error_cause, gone.compile_s) == ("gone", "aborted", None)
        assert log.take() == []
    finally:
        eng.grammar_waits = None
    eng.add_request("unwatched", PROMPTS[0], SamplingParams(max_tokens=8, temperature=0, structured=spec))
    assert _step_until_done(eng, "unwatched").finish_reason == "stop" and log.take() == []


def test_schema_limits_refuse_before_compiling(llm):
    eng = llm.engine
    deep: dict = {"type": "string"}
    for _ in range(250):
        deep = {"type": "array", "items": deep}
    cases = [({"type": "string", "maxLength": 1e12}, "maxLength"), (deep, "deeper"),
             ({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(600)}}, "properties")]
    for schema, word in cases:
        with pytest.raises(InvalidRequestError) as exc:
            eng.grammars.compile(StructuredSpec("json_schema", json.dumps(schema)))
        assert exc.value.field == "response_format" and word in exc.value.message
    assert compile_error_text(RuntimeError("[10:00:00] /x/grammar_functor.cc:2340: Check failed: (a) is false: "
                                           "bad bound")) == "bad bound"
    assert ".cc" not in compile_error_text(RuntimeError("/x/y.cc:12: internal"))


def test_resumed_request_continues_its_grammar(tiny_model_dir):
    kw = dict(model=tiny_model_dir("llama"), dtype="float32", num_kv_blocks=64, block_size=4, max_model_len=300)
    pre, dec = LLMEngine(**kw), LLMEngine(**kw)
    spec = StructuredSpec("json_schema", json.dumps(SCHEMA))
    params = SamplingParams(max_tokens=160, temperature=1.0, seed=7, structured=spec)
    prompt = PROMPTS[1]
    pre.grammars.compile(spec)  # compiled before: the first step prefills it
    pre.add_request("r", prompt, params, prefill_only=True)
    first = [o for o in pre.step() if o.request_id == "r"][0]
    ids = KVLending(dec).allocate_blocks(len(prompt))
    dec.runner.kv_cache[ids] = pre.runner.kv_cache[first.block_ids]
    KVLending(pre).release_prefilled("r")
    dec.grammars.compile(spec)  # compiled: the refusal below comes at once (the caller keeps the blocks)
    with pytest.raises(InvalidRequestError) as exc:  # tokens the grammar does not allow
        KVLending(dec).add_prefilled_request("x", prompt, [first.token_ids[0], 999], params, ids, len(prompt))
    assert exc.value.field == "output_token_ids"
    KVLending(dec).add_prefilled_request("r", prompt, first.token_ids, params, ids, len(prompt))
    done = None
    while dec.has_unfinished_requests():
        done = [o for o in dec.step() if o.finished] or done
    assert done[0].finish_reason == "stop"
    jsonschema.validate(json.loads(done[0].text), SCHEMA)
    dec.check_integrity()


def test_stream_moved_with_its_output_in_the_prompt_continues_exactly(llm):
    """A stream whose worker died is recomputed elsewhere with prompt = prompt + what the client has
    (`num_resumed_output` of it): its grammar and its output penalties continue after those tokens, so
    the greedy output equals the uninterrupted one."""
    spec = StructuredSpec("json_schema", json.dumps(SCHEMA))
    params = SamplingParams(max_tokens=160, temperature=0, structured=spec, frequency_penalty=0.5, presence_penalty=0.3)
    prompt = PROMPTS[3]
    whole = llm.generate([prompt], [params])[0]
    assert whole.finish_reason == "stop"
    k = len(whole.token_ids) // 2
    eng = llm.engine
    rest = SamplingParams(max_tokens=160 - k, temperature=0, structured=spec, frequency_penalty=0.5, presence_penalty=0.3)
    with pytest.raises(InvalidRequestError) as exc:
        eng.add_request("bad", prompt, rest, num_resumed_output=len(prompt))
    assert exc.value.field == "num_resumed_output"
    eng.add_request("moved", prompt + whole.token_ids[:k], rest, num_resumed_output=k)
    tail: list[int] = []
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.request_id == "moved" and o.finished:
                tail = o.token_ids
    assert whole.token_ids[:k] + tail == whole.token_ids


def test_constrained_requests_do_not_speculate(tiny_model_dir):
    llm = LLM(model=tiny_model_dir("llama"), dtype="float32", num_kv_blocks=128, block_size=4, max_model_len=300,
              speculative_method="ngram", speculative_adaptive=False)
    spec = StructuredSpec("regex", "(ab){20}")
    out = llm.generate([[7, 8, 9, 7, 8, 9, 7, 8, 9]], SamplingParams(max_tokens=80, temperature=0, structured=spec))[0]
    assert out.text == "ab" * 20 and llm.engine.spec_stats().num_drafted == 0


def test_mixed_batch_and_a_failing_matcher_fails_alone(llm):
    spec = StructuredSpec("regex", "[0-9]{4}")
    plain = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=5, temperature=0))[0]
    real_fill = GrammarState.fill_mask
    calls = []

    def flaky(self, bitmask, index):
        calls.append(index)
        if len(calls) == 2:
            raise RuntimeError("matcher broke")
        real_fill(self, bitmask, index)

    params = [SamplingParams(max_tokens=5, temperature=0), SamplingParams(max_tokens=8, temperature=0, structured=spec),
              SamplingParams(max_tokens=8, temperature=0, structured=spec)]
    with mock.patch.object(GrammarState, "fill_mask", flaky):
        outs = llm.generate(PROMPTS[:1] * 3, params)
    assert outs[0].token_ids == plain.token_ids
    reasons = sorted(o.finish_reason for o in outs[1:])
    assert reasons == ["error", "stop"]
    bad = [o for o in outs[1:] if o.finish_reason == "error"][0]
    good = [o for o in outs[1:] if o.finish_reason == "stop"][0]
    assert "structured" in bad.error and re.fullmatch("[0-9]{4}", good.text)


def test_bounded_strings_refuse_control_characters(llm):
    """xgrammar 0.2.8 lets raw control characters into length-bounded strings; the engine's schema
    rewrite keeps them out (the output would not be JSON)."""
    state = llm.engine.grammars.new_state(StructuredSpec("json_schema", json.dumps(SCHEMA)))
    assert not state.matcher.accept_string('{"name": "ab\x07')
    assert state.matcher.accept_string('{"name": "abc", "age": 7, "ok": true, "tag": "red"}')
    state = llm.engine.grammars.new_state(StructuredSpec("json_schema", json.dumps(SCHEMA)))
    assert state.matcher.accept_string('{"name": "abcdef')
    assert not state.matcher.accept_string('g')  # still at most 6 characters
