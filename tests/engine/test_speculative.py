"""Speculative decoding in the engine: greedy output identical to speculation off and to transformers'
`generate` (with preemption, chunked prefill, prefix caching, a KV handoff and a migration); sampled
output distributed as without speculation; rollback leaves no block behind; stops inside accepted
drafts end the request at that token."""

from __future__ import annotations

import random

import pytest
import torch

from device_params import DEVICES, skip_without_default_model
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.errors import EngineConfigError, InvalidRequestError
from engine.request import RequestOutput
from engine.spec.controller import SpecController
from engine.spec.controller import PROBE_EVERY
from engine.spec.speculator import EXPLORE_SEQS
from engine.kv_lending import KVLending
from test_correctness import hf_greedy, make_prompts, run_staggered, tiny_engine

GREEDY = dict(temperature=0, ignore_eos=True)


def drain(engine: LLMEngine) -> dict[str, RequestOutput]:
    """Step until idle; the final output of each request. Checks that the streamed `new_token_ids`
    add up to the final `token_ids` (their end, for a request that was stepped before), and that no
    block is leaked."""
    streamed: dict[str, list[int]] = {}
    done: dict[str, RequestOutput] = {}
    for _ in range(5000):
        if not engine.has_unfinished_requests():
            break
        for o in engine.step():
            streamed.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                done[o.request_id] = o
        engine.check_integrity()
        for r in engine.scheduler.running:  # exactly the blocks of the committed tokens' KV
            assert len(r.block_table) == engine.block_manager.blocks_for_tokens(r.num_computed_tokens)
    for rid, o in done.items():
        assert o.token_ids[len(o.token_ids) - len(streamed[rid]):] == streamed[rid], rid
    assert engine.block_manager.num_used_blocks == 0
    return done


def record_steps(engine: LLMEngine) -> list:
    """The `last_step` stats of every step `engine` takes from now on."""
    steps = []
    step = engine.step

    def recording_step():
        outs = step()
        steps.append(engine.last_step)
        return outs

    engine.step = recording_step
    return steps


def looping_prompts(vocab: int, seed: int) -> list[list[int]]:
    """Prompts that repeat themselves, and random ones: the tiny model's greedy output falls into
    loops after a while, which prompt lookup and suffix decoding then draft from."""
    rng = random.Random(seed)
    base = [rng.randrange(3, vocab) for _ in range(9)]
    return [base * 3, base[:4] * 5 + [11], *make_prompts(4, vocab, seed)]


_HF: dict[tuple, list[int]] = {}  # transformers' greedy outputs, computed once per (model, device, prompt, length)


def assert_matches_hf(engine: LLMEngine, prompts: list[list[int]], got: dict[str, list[int]], max_new: int) -> None:
    for i, p in enumerate(prompts):
        key = (engine.config.model, engine.config.device, tuple(p), max_new)
        if key not in _HF:
            _HF[key] = hf_greedy(engine.hf_model, p, max_new, engine.eos_token_ids)
        assert got[f"r{i}"] == _HF[key], f"prompt {i} differs"


_OFF: dict[str, dict[str, list[int]]] = {}  # speculation off, per device


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", ["ngram", "suffix"])
@pytest.mark.parametrize("attention", ["kernels", "torch"])
def test_greedy_is_identical_to_off_and_to_hf(tiny_model_dir, method, attention, device):
    """Drafted rows attend as decode rows: through the compiled kernel and through the torch path."""
    if device == "cuda" and attention == "kernels":
        pytest.skip("the compiled kernels are CPU-only")
    # Not adaptive: the tiny model's steps cost next to nothing, and this test is about the drafts' path.
    eng = tiny_engine(tiny_model_dir("llama"), device, num_kv_blocks=256, block_size=4, speculative_method=method,
                      speculative_adaptive=False)
    if attention == "torch":
        eng.runner.paged_decode = eng.runner.fused_ops = False
    steps = record_steps(eng)
    # The first prompt loops after 5 tokens, so it drafts while the later ones arrive (10 steps apart)
    # and are prefilled: steps with prompt chunks and drafts side by side.
    prompts = looping_prompts(eng.vocab_size, seed=32)[1:2] + looping_prompts(eng.vocab_size, seed=21)
    got = run_staggered(eng, prompts, 64, arrive_every=10)
    if device not in _OFF:
        _OFF[device] = run_staggered(tiny_engine(tiny_model_dir("llama"), device, num_kv_blocks=256, block_size=4),
                                     prompts, 64, arrive_every=10)
    assert got == _OFF[device]
    assert any(s.num_prefill_tokens and s.num_draft_tokens for s in steps)  # drafts beside a prompt
    assert_matches_hf(eng, prompts, got, 64)
    stats = eng.spec_stats()
    assert stats.method == method and stats.num_accepted > 0 and stats.num_drafted >= stats.num_accepted
    assert stats.num_emitted == stats.num_accepted + stats.num_verified_rows
    assert not eng.speculator.controller._accept  # every request's state went with it


def test_preemption_with_speculation_matches_hf(tiny_model_dir):
    # 48 blocks of 4 cannot hold 8 requests of up to 154 tokens: preemption must happen.
    eng = tiny_engine(tiny_model_dir("llama"), "cpu", num_kv_blocks=48, block_size=4, max_num_batched_tokens=64,
                      speculative_method="ngram", speculative_adaptive=False)
    prompts = looping_prompts(eng.vocab_size, seed=22) + make_prompts(2, eng.vocab_size, seed=23)
    got = run_staggered(eng, prompts, 48, arrive_every=1)
    assert_matches_hf(eng, prompts, got, 48)
    assert eng.scheduler.num_preemptions > 0 and eng.spec_stats().num_accepted > 0


def test_chunked_prefill_and_a_small_budget_with_speculation_match_hf(tiny_model_dir):
    # 16 tokens a step: long prompts go in chunks, and drafts get only what the step has left.
    eng = tiny_engine(tiny_model_dir("qwen2"), "cpu", num_kv_blocks=256, block_size=4, max_num_batched_tokens=16,
                      speculative_method="suffix", speculative_adaptive=False)
    steps = record_steps(eng)
    prompts = looping_prompts(eng.vocab_size, seed=24)
    got = run_staggered(eng, prompts, 48)
    assert_matches_hf(eng, prompts, got, 48)
    assert all(s.num_prefill_tokens + s.num_decode_tokens <= 16 for s in steps)
    assert any(s.num_prefill_tokens > 1 for s in steps) and eng.spec_stats().num_accepted > 0


def test_prefix_cache_holds_only_committed_kv(tiny_model_dir):
    """Blocks filled by accepted drafts enter the prefix cache and serve a later prompt exactly; the
    blocks of rejected drafts never do."""
    eng = tiny_engine(tiny_model_dir("llama"), "cpu", num_kv_blocks=256, block_size=4, speculative_method="ngram",
                      speculative_adaptive=False)
    prompt = looping_prompts(eng.vocab_size, seed=25)[0]
    eng.add_request("first", prompt, SamplingParams(max_tokens=80, **GREEDY))
    first = drain(eng)["first"].token_ids
    assert eng.spec_stats().num_accepted > 0
    longer = prompt + first[:70]
    eng.add_request("again", longer, SamplingParams(max_tokens=16, **GREEDY))
    again = drain(eng)["again"]
    assert again.num_cached_tokens == (len(longer) - 1) // 4 * 4  # every full block but the last token's
    assert again.token_ids == first[70:80] + hf_greedy(eng.hf_model, prompt + first[:80], 6, eng.eos_token_ids)
    assert again.token_ids == hf_greedy(eng.hf_model, longer, 16, eng.eos_token_ids)


@pytest.mark.parametrize("params", [
    dict(max_tokens=37, temperature=0, ignore_eos=True),
    dict(max_tokens=60, temperature=0, ignore_eos=True, stop_token_ids=["pick"]),
    dict(max_tokens=60, temperature=0, ignore_eos=True, stop=["pick"]),
    dict(max_tokens=60, temperature=0, ignore_eos=True, stop_token_ids=["pick"], min_tokens=45),
], ids=["max_tokens", "stop_token", "stop_string", "min_tokens"])
def test_a_stop_inside_accepted_drafts_ends_the_request_there(tiny_model_dir, params):
    """max_tokens, a stop token, a stop string and min_tokens' bans act on each verified token as they
    act on one sampled token: the same tokens, text and finish reason as speculation off."""
    off = tiny_engine(tiny_model_dir("llama"), "cpu", num_kv_blocks=256, block_size=4)
    eng = tiny_engine(tiny_model_dir("llama"), "cpu", num_kv_blocks=256, block_size=4, speculative_method="ngram",
                      speculative_adaptive=False)
    prompt = looping_prompts(off.vocab_size, seed=26)[0]
    off.add_request("probe", prompt, SamplingParams(max_tokens=60, **GREEDY))
    probe = drain(off)["probe"]
    pick = probe.token_ids[40]  # late in the output, where drafts are accepted
    params = {k: ([pick] if v == ["pick"] and k == "stop_token_ids" else v) for k, v in params.items()}
    if params.get("stop") == ["pick"]:
        params["stop"] = [off.tokenizer.decode(probe.token_ids[38:41])[-6:]]
    for e in (off, eng):
        e.add_request("r", prompt, SamplingParams(**params))
    want, got = drain(off)["r"], drain(eng)["r"]
    assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
    assert eng.spec_stats().num_accepted > 0


def test_drafts_never_run_past_the_context_limit(tiny_model_dir):
    prompt = None
    outs = {}
    for method in ("off", "ngram"):
        eng = tiny_engine(tiny_model_dir("llama"), "cpu", num_kv_blocks=64, block_size=4, max_model_len=60,
                          speculative_method=method, speculative_adaptive=False)
        prompt = looping_prompts(eng.vocab_size, seed=32)[1]  # loops after 5 tokens
        eng.add_request("r", prompt, SamplingParams(max_tokens=100, **GREEDY))
        outs[method] = drain(eng)["r"]
    assert outs["ngram"].token_ids == outs["off"].token_ids and outs["ngram"].finish_reason == "length"
    assert len(prompt) + len(outs["ngram"].token_ids) == 60 and eng.spec_stats().num_accepted > 0


class OracleProposer:
    """Drafts chosen from the target's own top tokens (some likely, some not, one outside top-k), so
    the sampled path sees accepted and rejected drafts alike."""

    def __init__(self, prompt_len: int, drafts: dict[tuple[int, ...], list[int]]):
        self.prompt_len, self.drafts = prompt_len, drafts

    def propose(self, seq_id: str, token_ids: list[int], max_tokens: int) -> list[int]:
        return self.drafts.get(tuple(token_ids[self.prompt_len:]), [])[:max_tokens]

    def finish(self, seq_id: str, token_ids: list[int]) -> None:
        pass


def _top_probs(model, ids: list[int], top_k: int, temperature: float) -> dict[int, float]:
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, -1].float() / temperature
    vals, idx = torch.topk(logits, top_k)
    return dict(zip(idx.tolist(), torch.softmax(vals, -1).tolist()))


def test_sampled_output_keeps_the_target_distribution(tiny_model_dir):
    """The first three tokens of 400 seeded requests (top_k=3, so 27 outcomes), with and without
    speculation, against the exact joint distribution computed from transformers' logits.

    Tolerance: chi-square with 26 degrees of freedom below 54.05 (p = 0.001) for each run, so a
    correct sampler fails it one time in a thousand seed sets (the seeds are fixed: it is
    deterministic); a sampler that ignores rejections or draws residuals wrongly shifts whole
    outcomes' mass: accepting every draft draws a token top-k rules out, and drawing a rejected position's
    token from p instead of the residual scores 85 here."""
    off = tiny_engine(tiny_model_dir("llama"), "cpu", num_kv_blocks=512, block_size=4, max_num_seqs=128,
                      max_num_batched_tokens=2048)
    eng = tiny_engine(tiny_model_dir("llama"), "cpu", num_kv_blocks=512, block_size=4, max_num_seqs=128,
                      max_num_batched_tokens=2048, speculative_method="ngram", num_speculative_tokens=2, speculative_adaptive=False)
    prompt, temp, k = [101, 2047, 33, 981, 4410], 1.3, 3
    model = off.hf_model
    exact: dict[tuple[int, ...], float] = {}
    drafts: dict[tuple[int, ...], list[int]] = {}
    p1 = _top_probs(model, prompt, k, temp)
    for rank1, (t1, q1) in enumerate(sorted(p1.items(), key=lambda kv: -kv[1])):
        p2 = _top_probs(model, prompt + [t1], k, temp)
        order2 = sorted(p2, key=lambda t: -p2[t])
        for t2, q2 in p2.items():
            for t3, q3 in _top_probs(model, prompt + [t1, t2], k, temp).items():
                exact[(t1, t2, t3)] = q1 * q2 * q3
        # A likely draft, a less likely one, or one outside the top-k (p = 0: always rejected).
        d2 = [order2[0], order2[2], 7][rank1]
        p3 = _top_probs(model, prompt + [t1, d2], k, temp) if d2 in p2 else {7: 1.0}
        drafts[(t1,)] = [d2, max(p3, key=p3.get)]
    eng.speculator.proposer = OracleProposer(len(prompt), drafts)
    n = 400
    for e in (off, eng):
        for i in range(n):
            e.add_request(f"s{i}", prompt, SamplingParams(max_tokens=4, temperature=temp, top_k=k, seed=i))
    keys = sorted(exact)
    for e in (off, eng):
        outs = drain(e)
        counts = torch.zeros(len(keys))
        for o in outs.values():
            drawn = tuple(o.token_ids[:3])
            assert drawn in exact, f"drew {drawn}, which top_k={k} rules out"
            counts[keys.index(drawn)] += 1
        expected = torch.tensor([exact[key] for key in keys]) * n
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < 54.05, f"{'speculative' if e is eng else 'plain'} sampling: chi-square {chi2:.1f}"
    stats = eng.spec_stats()
    # Every request verified one or two drafts (two while the engine's acceptance rate stays high).
    assert stats.num_verified_rows == n and n < stats.num_drafted <= 2 * n
    assert 0 < stats.num_accepted < stats.num_drafted


def test_per_request_opt_out_draws_as_without_speculation(tiny_model_dir):
    off = tiny_engine(tiny_model_dir("llama"), "cpu", num_kv_blocks=128, block_size=4)
    eng = tiny_engine(tiny_model_dir("llama"), "cpu", num_kv_blocks=128, block_size=4, speculative_method="suffix")
    prompt = looping_prompts(off.vocab_size, seed=27)[0]
    for e in (off, eng):
        e.add_request("seeded", prompt, SamplingParams(max_tokens=40, temperature=0.7, seed=5, speculative=False))
        e.add_request("greedy", prompt, SamplingParams(max_tokens=60, speculative=False, **GREEDY))
    want, got = drain(off), drain(eng)
    assert {r: o.token_ids for r, o in got.items()} == {r: o.token_ids for r, o in want.items()}
    assert eng.spec_stats().num_drafted == 0
    with pytest.raises(InvalidRequestError) as exc:
        SamplingParams(speculative="yes")
    assert exc.value.field == "speculative"


def test_abort_and_a_failing_row_drop_speculation_state(tiny_model_dir):
    eng = tiny_engine(tiny_model_dir("llama"), "cpu", num_kv_blocks=128, block_size=4, speculative_method="ngram",
                      speculative_adaptive=False)
    prompt = looping_prompts(eng.vocab_size, seed=32)[1]  # loops after 5 tokens
    for rid in ("keep", "abort"):
        eng.add_request(rid, prompt, SamplingParams(max_tokens=150, **GREEDY))
    poison = SamplingParams(max_tokens=300, temperature=0.5, ignore_eos=True)
    eng.add_request("poison", prompt, poison)
    while eng.spec_stats().num_accepted == 0:
        assert not any(o.finished for o in eng.step())
    assert eng.abort("abort")
    poison.temperature = float("nan")  # behind validation's back: its rows turn to NaN
    done = drain(eng)
    assert done["poison"].finish_reason == "error" and done["keep"].finish_reason == "length"
    assert not eng.speculator.controller._accept and not eng.speculator.proposer._seqs
    off = tiny_engine(tiny_model_dir("llama"), "cpu", num_kv_blocks=128, block_size=4)
    off.add_request("keep", prompt, SamplingParams(max_tokens=150, **GREEDY))
    assert drain(off)["keep"].token_ids == done["keep"].token_ids


def test_integrity_check_catches_a_draft_block_left_behind(tiny_model_dir):
    eng = tiny_engine(tiny_model_dir("llama"), "cpu", num_kv_blocks=64, block_size=4, speculative_method="ngram",
                      speculative_adaptive=False)
    eng.add_request("r", looping_prompts(eng.vocab_size, seed=32)[1], SamplingParams(max_tokens=50, **GREEDY))
    while eng.spec_stats().num_drafted == 0:
        eng.step()
    eng.check_integrity()
    req = eng.scheduler.running[0]
    req.block_table += eng.block_manager.allocate(2)  # as if two drafts' blocks outlived their step
    with pytest.raises(AssertionError, match="holds"):
        eng.check_integrity()
    assert eng.abort("r")
    eng.check_integrity()
    assert eng.block_manager.num_used_blocks == 0


def test_kv_handoff_into_and_migration_out_of_a_speculating_engine(tiny_model_dir):
    """Disaggregated: a prefill engine hands the prompt's KV to a speculating decode engine; midway the
    sequence moves to a third engine, which takes the blocks the decode engine pinned (committed KV
    only) into its prefix cache and recomputes the rest. The output is transformers' token for token."""
    path = tiny_model_dir("llama")
    pre = tiny_engine(path, "cpu", num_kv_blocks=64, block_size=4)
    dec = tiny_engine(path, "cpu", num_kv_blocks=64, block_size=4, speculative_method="ngram",
                      speculative_adaptive=False)
    dst = tiny_engine(path, "cpu", num_kv_blocks=64, block_size=4)
    prompt = looping_prompts(pre.vocab_size, seed=29)[1]  # loops after 10 tokens
    pre.add_request("r", prompt, SamplingParams(max_tokens=60, **GREEDY), prefill_only=True)
    first = drain_prefilled(pre)
    ids = KVLending(dec).allocate_blocks(len(prompt))
    dec.runner.kv_cache[ids] = pre.runner.kv_cache[first.block_ids]
    KVLending(pre).release_prefilled("r")
    KVLending(dec).add_prefilled_request("r", prompt, first.token_ids, SamplingParams(max_tokens=60, **GREEDY), ids, len(prompt))
    out = list(first.token_ids)
    while len(out) < 45:
        for o in dec.step():
            out += o.new_token_ids
    assert dec.spec_stats().num_accepted > 0
    req = dec.scheduler.running[0]
    assert len(req.block_table) == -(-req.num_computed_tokens // 4) and req.num_computed_tokens == req.num_tokens - 1
    tokens = prompt + out
    pinned = KVLending(dec).pin_computed_blocks("r", len(tokens))
    assert len(pinned) == req.num_computed_tokens // 4
    copies = KVLending(dst).allocate_blocks(len(pinned) * 4)
    dst.runner.kv_cache[copies] = dec.runner.kv_cache[pinned]
    KVLending(dec).free_blocks(pinned)
    assert dec.abort("r")
    dec.check_integrity()
    assert dec.block_manager.num_used_blocks == 0
    KVLending(dst).cache_blocks(tokens, copies)
    dst.add_request("r", tokens, SamplingParams(max_tokens=60 - len(out), **GREEDY))
    rest = drain(dst)["r"]
    assert rest.num_cached_tokens == len(pinned) * 4
    assert out + rest.token_ids == hf_greedy(dec.hf_model, prompt, 60, dec.eos_token_ids)


def drain_prefilled(engine: LLMEngine) -> RequestOutput:
    while True:
        for o in engine.step():
            if o.finished:
                return o


def test_speculation_settings_are_checked():
    with pytest.raises(EngineConfigError, match="speculative_method"):
        EngineConfig(speculative_method="eagle")
    with pytest.raises(EngineConfigError, match="num_speculative_tokens"):
        EngineConfig(num_speculative_tokens=0)


def test_controller_estimates_recover_and_probes_refresh_them():
    """A sequence whose first guesses all failed drafts again after a few steps (its estimate ages back
    to the engine's average instead of shutting it out for good), and a worker whose model says drafts
    do not pay lets a few sequences draft one token every PROBE_EVERY steps, taking turns."""
    cheap = SpecController(max_drafts=4)
    for n in range(1, 40):  # SmolLM2 on one CPU thread: 57 ms + 2 ms per token
        cheap.record_step(n, 0.057 + 0.002 * n)
    for _ in range(20):
        cheap.record_verify("copier", 4, 4)
    assert cheap.budget(["opening"]) > 0
    for _ in range(6):  # an opening sentence: nothing held
        cheap.record_verify("opening", 2, 0)
    assert cheap.acceptance("opening") < 0.1 and cheap.budget(["opening"]) == 0
    steps_off = 1
    while cheap.budget(["opening"]) == 0:
        steps_off += 1
        assert steps_off < 12, "the sequence never drafted again"
    assert cheap.acceptance("opening") > 0.1

    costly = SpecController(max_drafts=4)
    for n in range(64, 640, 16):  # compute-bound steps: 5 ms + 2 ms per token
        costly.record_step(n, 0.005 + 0.002 * n)
    batch = [f"b{i}" for i in range(64)]
    budgets = [costly.budget(batch) for _ in range(2 * PROBE_EVERY)]
    assert budgets.count(1) == 2 and set(budgets) == {0, 1}
    assert budgets[PROBE_EVERY - 1] == 1 and costly.exploring
    assert costly.budget(batch) == 0 and not costly.exploring


class AskedProposer:
    """Guesses nothing; records which sequences it was asked about."""

    def __init__(self):
        self.asked: list[str] = []

    def propose(self, seq_id: str, token_ids: list[int], max_tokens: int) -> list[int]:
        self.asked.append(seq_id)
        return []

    def finish(self, seq_id: str, token_ids: list[int]) -> None:
        pass


def test_exploring_steps_take_turns_over_the_batch(tiny_model_dir):
    eng = tiny_engine(tiny_model_dir("llama"), "cpu", num_kv_blocks=256, block_size=4, speculative_method="ngram",
                      max_num_seqs=32)
    spec = eng.speculator
    spec.proposer = AskedProposer()
    n = 3 * EXPLORE_SEQS
    for i in range(n):
        eng.add_request(f"r{i}", [5 + i, 6, 7, 8], SamplingParams(max_tokens=40, **GREEDY))
    while len(eng.scheduler.running) < n or any(r.num_tokens - r.num_computed_tokens > 1 for r in eng.scheduler.running):
        eng.step()
    spec.controller.budget = lambda ids, explore=True: setattr(spec.controller, "exploring", True) or 1
    spec.proposer.asked.clear()
    for _ in range(3):
        spec.propose(eng.scheduler.running, eng.max_model_len)
    asked = spec.proposer.asked
    assert len(asked) == n and len(set(asked)) == n  # three exploring steps, eight different sequences each


def test_smollm2_copying_accepts_most_drafts_and_matches_hf():
    """The real model asked to repeat a text: prompt lookup guesses most of the output."""
    skip_without_default_model()
    eng = tiny_engine(None, "cpu", num_kv_blocks=64, block_size=16, speculative_method="ngram")
    text = ("The block manager owns the free list, the reference counts and the chained hashes of full "
            "blocks. The scheduler only asks it whether blocks can be allocated, and frees them.")
    prompt = eng.apply_chat_template([{"role": "user", "content": f"Repeat this text exactly:\n\n{text}"}])
    eng.add_request("copy", prompt, SamplingParams(max_tokens=32, temperature=0))
    got = drain(eng)["copy"].token_ids
    assert got == hf_greedy(eng.hf_model, prompt, 32, eng.eos_token_ids)
    stats = eng.spec_stats()
    assert stats.acceptance_rate > 0.5 and stats.mean_accepted_length > 2, stats
