"""The parts of speculative decoding that need no model: proposers, verification, the controller."""

from __future__ import annotations

import torch

from engine.spec.controller import SpecController
from engine.spec.ngram import NgramProposer
from engine.spec.proposer import make_proposer
from engine.spec.suffix import SuffixProposer
from engine.spec.verify import verify_greedy, verify_sampled


def test_ngram_proposes_what_followed_the_last_earlier_occurrence():
    p = NgramProposer(min_n=2, max_n=3)
    seq = [1, 2, 3, 4, 5, 9, 9, 2, 3]
    assert p.propose("s", seq, 3) == [4, 5, 9]
    # Incremental: appending tokens keeps the index up to date (the latest occurrence wins).
    seq += [4, 7, 7, 2, 3]
    assert p.propose("s", seq, 2) == [4, 7]
    assert p.propose("s", [5, 6, 7, 8], 3) == []  # rebuilt for a shorter sequence, nothing repeats
    p.finish("s", seq)
    assert p.propose("new", [1, 2], 4) == []


def test_suffix_proposer_follows_frequent_continuations_and_learns_from_finished_outputs():
    p = SuffixProposer(max_match=4, min_prob=0.3)
    seq = [7, 8, 9, 10, 11] * 3 + [7, 8]
    assert p.propose("a", seq, 4) == [9, 10, 11, 7]
    # A pattern never seen in this sequence comes from a finished one.
    p.finish("done", [50, 51, 52, 53, 54, 55])
    assert p.propose("b", [1, 2, 50, 51], 3) == [52, 53, 54]
    # Low confidence stops drafting: after 60 came four different tokens, each once (p = 0.25 < 0.3).
    p.finish("split", [60, 61, 60, 62, 60, 63, 60, 64])
    assert p.propose("c", [60], 3) == []


def test_make_proposer_names_the_methods():
    assert make_proposer("off") is None
    assert isinstance(make_proposer("ngram"), NgramProposer)
    try:
        make_proposer("eagle")
    except ValueError as e:
        assert "off, ngram, suffix" in str(e)
    else:
        raise AssertionError("unknown method accepted")


def test_greedy_verification_takes_the_longest_matching_prefix_plus_one():
    assert verify_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]
    assert verify_greedy([5, 6, 7, 8], [5, 9, 7]) == [5, 6]
    assert verify_greedy([4], []) == [4]
    assert verify_greedy([1, 2], [3]) == [1]


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    return float((((counts - expected) ** 2)[keep] / expected[keep]).sum())


def test_rejection_sampling_preserves_the_target_distribution():
    """Emitted tokens are distributed as the target's p whatever the drafts: the first token over many
    draws (draft = a likely token, then an unlikely one), and the second token given the first draft
    was accepted. Chi-square with 4 degrees of freedom: 18.5 is its 0.1% tail."""
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05], [0.1, 0.1, 0.6, 0.1, 0.1], [0.2] * 5])
    n = 20000
    for draft0 in (0, 4):
        first = torch.zeros(5)
        second = torch.zeros(5)
        for _ in range(n):
            out = verify_sampled(p, [draft0, 2], g)
            first[out[0]] += 1
            if out[0] == draft0 and len(out) > 1:
                second[out[1]] += 1
        assert _chi2(first, p[0]) < 18.5, (draft0, first / n)
        assert _chi2(second, p[1]) < 18.5, (draft0, second / second.sum())


def test_controller_speculates_when_tokens_are_cheap_and_stops_when_they_are_not():
    memory_bound = SpecController(max_drafts=4)
    for n in range(1, 40):  # a step costs ~ the weights' read: 50 ms + 0.1 ms per token
        memory_bound.record_step(n, 0.050 + 0.0001 * n)
    seqs = [f"s{i}" for i in range(4)]
    for s in seqs:
        for _ in range(10):
            memory_bound.record_verify(s, 4, 3)
    assert memory_bound.budget(seqs) >= 3
    assert memory_bound.draft_len("s0", 4) >= 3

    compute_bound = SpecController(max_drafts=4)
    for n in range(64, 640, 16):  # every token costs its share: 5 ms + 2 ms per token
        compute_bound.record_step(n, 0.005 + 0.002 * n)
    big = [f"b{i}" for i in range(128)]
    for s in big:
        compute_bound.record_verify(s, 4, 2)
    assert compute_bound.budget(big) == 0
    assert SpecController(max_drafts=3, adaptive=False).budget(big) == 3
    # A sequence that never accepts drafts gets one at most.
    c = SpecController()
    for _ in range(10):
        c.record_verify("x", 4, 0)
    assert c.draft_len("x", 4) == 1
    assert (c.num_drafted, c.num_accepted, c.num_emitted) == (40, 0, 10)
