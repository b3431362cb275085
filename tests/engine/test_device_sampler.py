"""engine.device_sampler.sample_on_device against engine.sampler.sample (the reference): greedy tokens,
in-place logits edits and logprobs identical; random draws distributed as `row_probs` says (chi-square),
speculative verification keeping the target's distribution; seeded draws independent of the batch and
of the device; errors confined to their request; grammar masks; one device-to-host read per step.

Chi-square tolerance: each check is below the p = 0.001 critical value (Wilson-Hilferty), so a correct
sampler fails one check in a thousand seed sets; the seeds are fixed, so each run is deterministic."""

from __future__ import annotations

import contextlib
import math
from unittest import mock

import pytest
import torch

from engine import device_sampler
from engine.device_sampler import sample_on_device
from engine.logits_processing import apply_penalties
from engine.logprobs import token_logprobs
from engine.request import Request
from engine.sampler import row_probs, sample
from engine.sampling.noise import STREAM_ACCEPT, STREAM_DRAW, exponentials, row_keys, seed_words, to_unit, token_hashes
from engine.sampling_params import SamplingParams

VOCAB = 40
EOS = frozenset({0})


def make(params: dict | SamplingParams, prompt=(1, 2, 3), output=(), seed: int = 0) -> Request:
    """A request as an engine holds it: a seed for each sampler (the reference's generator, ours)."""
    p = params if isinstance(params, SamplingParams) else SamplingParams(**params)
    req = Request(f"r{seed}", list(prompt), p)
    req.output_token_ids = list(output)
    s = p.seed if p.seed is not None else seed
    req.sample_seed, req.generator = s, torch.Generator().manual_seed(s)
    return req


def _critical(df: int, z: float = 3.0902) -> float:
    """The chi-square value exceeded with probability 0.001 (z: the normal's 0.999 quantile)."""
    a = 2 / (9 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


def assert_distributed_as(tokens: list[int], probs: torch.Tensor, what: str) -> None:
    """Chi-square of `tokens`' counts against `probs`, bins merged (smallest first) to >= 5 expected."""
    n = len(tokens)
    counts = torch.bincount(torch.tensor(tokens, dtype=torch.long), minlength=probs.numel()).double()
    assert counts[probs == 0].sum() == 0, f"{what}: drew a token of probability 0"
    expected = probs.double() * n
    obs, exp, acc_o, acc_e = [], [], 0.0, 0.0
    for t in expected.argsort().tolist():
        acc_o, acc_e = acc_o + float(counts[t]), acc_e + float(expected[t])
        if acc_e >= 5:
            obs.append(acc_o)
            exp.append(acc_e)
            acc_o = acc_e = 0.0
    obs[-1] += acc_o
    exp[-1] += acc_e
    chi2 = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    assert len(obs) > 1 and chi2 < _critical(len(obs) - 1), f"{what}: chi-square {chi2:.1f} over {len(obs)} bins"


def _base(seed: int, rows: int = 1, scale: float = 1.5) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * scale


# ----------------------------------------------------------------------------------------- noise

M32 = 0xFFFFFFFF


def _fmix(h: int) -> int:
    h ^= h >> 16
    h = h * 0x85EBCA6B & M32
    h ^= h >> 13
    h = h * 0xC2B2AE35 & M32
    return h ^ (h >> 16)


def _py_hash(seed: int, position: int, stream: int, token: int) -> int:
    """The noise's definition in plain Python integers (what a seed's text depends on)."""
    h = _fmix(stream * 0x27D4EB2F & M32)
    for word in (*seed_words(seed), position):
        h = _fmix(((h ^ word) * 0x9E3779B1 + 0x7F4A7C15) & M32)
    t = _fmix((token * 0x9E3779B1 & M32) ^ 0x3C6EF372)
    return _fmix(_fmix(t ^ h) ^ _fmix(h ^ 0x68E31DA4))


def test_noise_bits_follow_their_definition():
    seeds, positions = [0, 1, 2**64 - 1, -(2**63), 123456789012], [0, 7, 2**31 - 1, 1000, 5]
    words = [seed_words(s) for s in seeds]
    keys = row_keys(torch.tensor([w[0] for w in words]), torch.tensor([w[1] for w in words]),
                    torch.tensor(positions), STREAM_DRAW)
    got = token_hashes(keys, 300)
    for r, (seed, pos) in enumerate(zip(seeds, positions)):
        for t in (0, 1, 31, 299):
            assert int(got[r, t]) == _py_hash(seed, pos, STREAM_DRAW, t)


def test_uniforms_are_never_0_or_1():
    """The extremes of the hash map inside (0, 1): the race never divides by an exponential of 0."""
    u = to_unit(torch.tensor([0, 1, 2**31, 2**32 - 512, 2**32 - 1]))
    assert float(u.min()) > 0 and float(u.max()) < 1
    e = exponentials(torch.tensor([0, 2**32 - 1]), 1 << 14)
    assert bool(torch.isfinite(e).all()) and float(e.min()) > 0


# ---------------------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("trial", range(4))
def test_greedy_tokens_and_edited_logits_equal_the_reference(trial):
    """Ties included (integer logits): the argmax takes the first maximum, as the reference does."""
    g = torch.Generator().manual_seed(trial)
    logits = torch.randint(-3, 4, (8, VOCAB), generator=g).float()
    top = logits.argmax(dim=-1).tolist()
    reqs = [make(dict(temperature=0)),
            make(dict(temperature=0), seed=1),  # drafts: two that match the argmax, then a miss
            make(dict(temperature=0, repetition_penalty=1.5, frequency_penalty=0.7, presence_penalty=-0.2,
                      logit_bias={3: 2.5, top[5]: -4.0}), prompt=(3, 7, 7), output=(7, 9, 9, top[5]), seed=2),
            make(dict(temperature=0, min_tokens=3, stop_token_ids=[top[6], 5]), output=(1,), seed=3),
            make(dict(temperature=0.8, seed=4))]
    drafts = [[], [top[1], top[2], (top[3] + 1) % VOCAB], [], [], []]
    ref_logits, dev_logits = logits.clone(), logits.clone()
    ref = sample(ref_logits, reqs, EOS, drafts)
    got = sample_on_device(dev_logits, reqs, EOS, drafts)
    assert got.token_ids[:4] == ref.token_ids[:4] and got.token_ids[1][:2] == top[1:3]
    assert not got.errors and not ref.errors
    assert torch.equal(dev_logits, ref_logits)  # bias, penalties and bans, bit for bit


def test_all_greedy_rows_pay_for_nothing_else():
    boom = mock.Mock(side_effect=AssertionError("called for a plain greedy batch"))
    logits = _base(5, rows=3)
    paths = ["engine.device_sampler." + f for f in ("sampling_probs", "draw", "raw_logprobs", "pick_logprobs")]
    paths += ["engine.sampling.device_ops._penalize", "engine.sampling.device_ops._mask_grammar"]
    with contextlib.ExitStack() as stack:
        for path in paths:
            stack.enter_context(mock.patch(path, boom))
        got = sample_on_device(logits.clone(), [make(dict(temperature=0), seed=i) for i in range(3)], EOS)
    assert got.token_ids == [[t] for t in logits.argmax(dim=-1).tolist()] and got.logprobs is None


# ---------------------------------------------------------------------------------- distributions

COMBOS = {
    "temperature": dict(temperature=0.7),
    "top_k": dict(temperature=1.3, top_k=7),
    "top_p": dict(temperature=1.0, top_p=0.8),
    "min_p": dict(temperature=0.9, min_p=0.05),
    "all_filters": dict(temperature=1.2, top_k=12, top_p=0.9, min_p=0.02),
    "penalties_bias": dict(temperature=1.1, repetition_penalty=1.6, frequency_penalty=0.5, presence_penalty=0.3,
                           logit_bias={5: 3.0, 9: -2.0}),
    "min_tokens": dict(temperature=1.0, min_tokens=5, stop_token_ids=[1, 2, 3]),
}


@pytest.mark.parametrize("name", COMBOS)
def test_draws_follow_row_probs(name):
    """3000 requests of one row each (seeds 0..2999) against the reference's distribution."""
    base = _base(10)
    prompt, output = (3, 7, 7, 11), (11, 5, 20, 20, 5)
    n = 3000
    reqs = [make(dict(COMBOS[name], seed=s), prompt, output if name == "penalties_bias" else ()) for s in range(n)]
    got = sample_on_device(base.expand(n, VOCAB).clone(), reqs, EOS)
    assert not got.errors
    row, p = base[0].clone(), reqs[0].params
    if p.has_penalties:
        apply_penalties(row, p, list(prompt), list(output))
    if p.min_tokens:
        row[p.stop_token_ids + sorted(EOS)] = float("-inf")
    assert_distributed_as([t[0] for t in got.token_ids], row_probs(row, p), name)


def test_draws_over_positions_of_one_seed_follow_row_probs():
    base, n = _base(11), 1500
    filler = [1] * n
    reqs = [make(dict(temperature=1.0, top_k=20, seed=7), prompt=filler[:k]) for k in range(1, n + 1)]
    got = sample_on_device(base.expand(n, VOCAB).clone(), reqs, EOS)
    assert_distributed_as([t[0] for t in got.token_ids], row_probs(base[0].clone(), reqs[0].params), "positions")


def test_a_top_p_that_rounds_to_zero_keeps_the_top_token():
    base = _base(13)
    reqs = [make(dict(temperature=1.0, top_p=1e-50, seed=s)) for s in range(20)]
    got = sample_on_device(base.expand(20, VOCAB).clone(), reqs, EOS)
    assert got.token_ids == [[int(base.argmax())]] * 20


def test_rejection_sampling_keeps_the_target_distribution():
    """Drafts [d1, d2] at three positions: the first emitted token is distributed as p0, the next (after
    d1 was accepted) as p1, the third (both accepted) as p2; a draft of probability 0 is never emitted."""
    params = dict(temperature=1.0, top_k=10)
    base = _base(12, rows=3, scale=1.2)
    probs = [row_probs(base[j].clone(), SamplingParams(**params)) for j in range(3)]
    d1, d2 = int(probs[0].argmax()), int(probs[1].argsort(descending=True)[1])
    outside = int(probs[0].argmin())  # outside the top 10: probability 0
    n = 4000
    for drafts in ([d1, d2], [outside]):
        reqs = [make(dict(params, seed=s)) for s in range(n)]
        rows = base[:len(drafts) + 1].repeat(n, 1)
        got = sample_on_device(rows, reqs, EOS, [list(drafts) for _ in range(n)])
        assert not got.errors
        assert_distributed_as([t[0] for t in got.token_ids], probs[0], f"first token, drafts {drafts}")
        if drafts == [outside]:
            assert all(len(t) == 1 for t in got.token_ids)
            continue
        accepted = [t for t in got.token_ids if t[0] == d1]
        assert abs(len(accepted) / n - float(probs[0][d1])) < 4 * math.sqrt(float(probs[0][d1]) / n)
        assert_distributed_as([t[1] for t in accepted], probs[1], "second token")
        assert_distributed_as([t[2] for t in accepted if t[1] == d2], probs[2], "third token")


# ----------------------------------------------------------------------------------------- seeded

SEEDED = [dict(temperature=0.9, seed=11), dict(temperature=1.4, top_k=5, seed=12),
          dict(temperature=0.6, top_p=0.7, seed=13), dict(temperature=1.0, min_p=0.1, seed=14, logprobs=2), dict(temperature=1.0, repetition_penalty=1.3, seed=15),
          dict(temperature=1.2, seed=16), dict(temperature=0.8, seed=2**64 - 1), dict(temperature=0.8, seed=-(2**63))]
SEEDED_DRAFTS = [[], [], [], [], [], [4, 9], [], []]


def _seeded_batch(order: list[int], logits: torch.Tensor, extra: bool) -> dict[int, list[int]]:
    reqs = [make(SEEDED[i], prompt=(2,) * (i + 2)) for i in order]
    drafts = [SEEDED_DRAFTS[i] for i in order]
    rows = [logits[i:i + 1 + len(SEEDED_DRAFTS[i])] for i in order]
    if extra:  # other requests in between, greedy and sampled
        reqs[1:1] = [make(dict(temperature=1.0, seed=99)), make(dict(temperature=0))]
        drafts[1:1] = [[], []]
        rows[1:1] = [_base(20), _base(21)]
    got = sample_on_device(torch.cat(rows), reqs, EOS, drafts)
    assert not got.errors
    ids = [i for i in order]
    if extra:
        ids[1:1] = [-1, -2]
    return {i: t for i, t in zip(ids, got.token_ids) if i >= 0}


def test_a_seed_draws_the_same_tokens_in_any_batch():
    logits = torch.randn(len(SEEDED) + 2, VOCAB, generator=torch.Generator().manual_seed(3)) * 2
    alone = {}
    for i in range(len(SEEDED)):
        alone.update(_seeded_batch([i], logits, extra=False))
    assert _seeded_batch(list(range(len(SEEDED))), logits, extra=False) == alone
    assert _seeded_batch(list(reversed(range(len(SEEDED)))), logits, extra=True) == alone
    # Another seed, or another position, is another draw: 32 of them cannot all agree.
    base = _base(30, scale=0.1)
    reqs = [make(dict(temperature=1.0, seed=s)) for s in range(32)]
    firsts = {tuple(t) for t in sample_on_device(base.expand(32, VOCAB).clone(), reqs, EOS).token_ids}
    assert len(firsts) > 1


# ----------------------------------------------------------------------------------------- errors


class FakeGrammar:
    """A grammar state that allows a fixed set of tokens (or whose matcher fails)."""

    def __init__(self, allowed: list[int], fail: bool = False):
        self.allowed, self.fail, self.bans_stops, self.accepted = set(allowed), fail, False, []

    def fill_mask(self, bitmask: torch.Tensor, index: int) -> None:
        if self.fail:
            raise RuntimeError("matcher broke")
        words = [0] * bitmask.shape[1]
        for t in self.allowed:
            words[t // 32] |= 1 << (t % 32)
        bitmask[index] = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)

    def accept(self, token_id: int) -> bool:
        self.accepted.append(token_id)
        return token_id in self.allowed


def test_a_bad_parameter_fails_only_its_request():
    good = [make(dict(temperature=0.9, seed=1)), make(dict(temperature=0)),
            make(dict(temperature=1.1, seed=2, logprobs=1))]
    bias = make(dict(temperature=0.5, seed=3, logit_bias={4: 1.0}))
    bias.params.logit_bias = {VOCAB + 3: 1.0}  # behind validation's back (no vocabulary there)
    nan = make(dict(temperature=0.5, seed=4))
    nan.params.temperature = float("nan")
    top_p = make(dict(temperature=0.5, seed=5))
    top_p.params.top_p = 0.0
    banned = make(dict(temperature=0.7, seed=6, min_tokens=2, stop_token_ids=list(range(1, VOCAB))))
    broken = make(dict(temperature=0.7, seed=7))
    broken.grammar = FakeGrammar([1], fail=True)
    logits = _base(40, rows=8)
    batch = [good[0], bias, good[1], nan, top_p, banned, good[2], broken]
    got = sample_on_device(logits.clone(), batch, EOS)
    fields = {1: "logit_bias", 3: "temperature", 4: "top_p", 5: "min_tokens", 7: "structured output"}
    assert set(got.errors) == set(fields) and all(fields[i] in got.errors[i] for i in fields), got.errors
    assert all(got.token_ids[i] == [] for i in fields)
    alone = sample_on_device(logits[[0, 2, 6]].clone(), good, EOS)
    assert [got.token_ids[i] for i in (0, 2, 6)] == alone.token_ids and not alone.errors
    assert list(got.logprobs) == [6] and got.logprobs[6] == alone.logprobs[2]


# ---------------------------------------------------------------------------------------- logprobs


def test_logprobs_equal_the_reference_ties_included():
    g = torch.Generator().manual_seed(8)
    logits = torch.cat([torch.randint(-2, 3, (3, VOCAB), generator=g).float(), _base(9, rows=2)])
    reqs = [make(dict(temperature=0, logprobs=k), seed=i) for i, k in enumerate((0, 1, 5))]
    reqs += [make(dict(temperature=0, logprobs=20), seed=3), make(dict(temperature=1.3, logprobs=3, seed=4))]
    ref = sample(logits.clone(), reqs, EOS)
    got = sample_on_device(logits.clone(), reqs, EOS)
    assert {i: got.logprobs[i] for i in range(4)} == {i: ref.logprobs[i] for i in range(4)}
    tok = got.token_ids[4][0]
    assert got.logprobs[4] == token_logprobs(logits[4:5], [tok], 3)  # the drawn token's, raw


# ----------------------------------------------------------------------------------------- grammar


@pytest.fixture(scope="module")
def compiler():
    xgr = pytest.importorskip("xgrammar")
    vocab = ["<eos>", "a", "b", "c", "ab", "1", "2"] + [f"x{i}" for i in range(VOCAB - 7)]
    return xgr.GrammarCompiler(xgr.TokenizerInfo(vocab, stop_token_ids=[0]))


def _state(compiled, tokens=(), bans_stops=False):
    from engine.structured import GrammarState

    state = GrammarState(compiled)
    for t in tokens:
        assert state.accept(t)
    state.bans_stops = bans_stops
    return state


def test_grammar_masks_equal_the_reference(compiler):
    """Three steps of a regex: the masked logits equal the reference's bit for bit (unconstrained rows
    untouched); the greedy token is the reference's; a sampled row never draws the disallowed token its
    logits favour."""
    compiled = compiler.compile_regex("(ab|c)+1")
    ref_greedy, dev_greedy = _state(compiled), _state(compiled)
    sampled = _state(compiled)
    for step in range(3):
        logits = _base(50 + step, rows=3)
        logits[2, 8] += 30.0  # "x1": never allowed
        ref_reqs = [make(dict(temperature=0)), make(dict(temperature=0.5, seed=1))]
        dev_reqs = [make(dict(temperature=0)), make(dict(temperature=0.5, seed=1)), make(dict(temperature=1.0, seed=2))]
        ref_reqs[0].grammar, dev_reqs[0].grammar, dev_reqs[2].grammar = ref_greedy, dev_greedy, sampled
        ref_logits, dev_logits = logits[:2].clone(), logits.clone()
        ref = sample(ref_logits, ref_reqs, EOS)
        got = sample_on_device(dev_logits, dev_reqs, EOS)
        assert not got.errors and got.token_ids[0] == ref.token_ids[0] and got.token_ids[2] != [8]
        assert torch.equal(dev_logits[:2], ref_logits)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_complete_grammar_gets_its_end_back_under_min_tokens(compiler, temperature):
    compiled = compiler.compile_grammar('root ::= "ab"')
    logits = _base(60)
    results = []
    for sampler in (sample, sample_on_device):
        req = make(dict(temperature=temperature, seed=3, min_tokens=5), output=(4,))
        req.grammar = _state(compiled, [4], bans_stops=True)
        results.append(sampler(logits.clone(), [req], EOS))
    assert results[0] == results[1] and results[1].token_ids == [[0]]


# ------------------------------------------------------------------------------ one read per step


def _everything() -> tuple[torch.Tensor, list[Request], list[list[int]]]:
    reqs = [make(dict(temperature=0)), make(dict(temperature=0.9, seed=1)), make(dict(temperature=0, logprobs=3)),
            make(dict(temperature=0.7, seed=2, top_p=0.9, top_k=5, min_p=0.05, logprobs=2)),
            make(dict(temperature=0.8, seed=3, repetition_penalty=1.2, frequency_penalty=0.4, logit_bias={1: 2.0}),
                 output=(5, 5, 6)),
            make(dict(temperature=0, min_tokens=4, stop_token_ids=[2])), make(dict(temperature=1.0, seed=4))]
    reqs[6].grammar = FakeGrammar(list(range(3, 20)))
    drafts = [[5, 6], [7, 8], [], [], [], [], []]
    return _base(70, rows=11), reqs, drafts


def test_one_device_to_host_read_per_step(monkeypatch):
    calls = []
    real = device_sampler.read_back
    monkeypatch.setattr(device_sampler, "read_back", lambda packed: calls.append(packed.shape) or real(packed))
    logits, reqs, drafts = _everything()
    got = sample_on_device(logits, reqs, EOS, drafts)
    assert not got.errors and len(calls) == 1 and set(got.logprobs) == {2, 3}
    sample_on_device(_base(71, rows=2), [make(dict(temperature=0)), make(dict(temperature=0))], EOS)
    assert len(calls) == 2


# --------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_noise_bits_equal_on_cpu_and_cuda():
    lo, hi = torch.tensor([0, 5, 2**32 - 1]), torch.tensor([0, 7, 2**32 - 1])
    pos = torch.tensor([0, 123456, 2**31 - 1])
    cpu = token_hashes(row_keys(lo, hi, pos, STREAM_ACCEPT), 50000)
    cuda = token_hashes(row_keys(lo.cuda(), hi.cuda(), pos.cuda(), STREAM_ACCEPT), 50000)
    assert torch.equal(cpu, cuda.cpu()) and cpu.min() >= 0 and cpu.max() < 2**32


@pytest.mark.gpu
def test_cuda_draws_equal_cpu_and_the_step_syncs_once(monkeypatch):
    """The same requests and logits on both devices give the same result; on CUDA nothing but
    `read_back` waits for the device (sync debug mode "error" everywhere else)."""
    logits, reqs, drafts = _everything()
    cpu = sample_on_device(logits.clone(), reqs, EOS, drafts)
    logits, reqs, drafts = _everything()
    real, calls = device_sampler.read_back, []

    def read(packed):
        calls.append(packed.device.type)
        torch.cuda.set_sync_debug_mode(0)
        try:
            return real(packed)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    sample_on_device(logits.cuda(), reqs, EOS, drafts)  # warm-up: caches on the device
    monkeypatch.setattr(device_sampler, "read_back", read)
    logits, reqs, drafts = _everything()
    dev = logits.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gpu = sample_on_device(dev, reqs, EOS, drafts)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert calls == ["cuda"]
    assert gpu.token_ids == cpu.token_ids and gpu.errors == cpu.errors
    for i, entries in cpu.logprobs.items():
        (a,), (b,) = entries, gpu.logprobs[i]
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-5
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
