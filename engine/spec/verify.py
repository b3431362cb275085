"""Acceptance of drafted tokens against the target model's distributions at each drafted position.

The drafts of model-free proposers are certain guesses (a point mass q at the draft d), so the
rejection rule of speculative sampling (Leviathan et al. 2023; Chen et al. 2023) becomes: accept d with
probability min(1, p(d) / q(d)) = p(d); on rejection draw from the residual max(0, p - q), which is p
with d removed, renormalized. Every emitted token is then distributed exactly as sampling from p
without speculation. Greedy rows accept the longest prefix that equals the target's argmax, so their
output is token for token what decoding without speculation gives.
"""

from __future__ import annotations

import torch


def verify_greedy(target_ids: list[int], drafts: list[int]) -> list[int]:
    """target_ids: the argmax at each of the len(drafts) + 1 positions. The emitted tokens: the drafts
    that match, then the target's own token where the first mismatch is (or after the last draft)."""
    assert len(target_ids) == len(drafts) + 1
    out = []
    for draft, target in zip(drafts, target_ids):
        out.append(target)
        if draft != target:
            return out
    out.append(target_ids[-1])
    return out


def verify_sampled(probs: torch.Tensor, drafts: list[int], generator: torch.Generator | None) -> list[int]:
    """probs: [len(drafts) + 1, vocab] on the CPU, the target's sampling distribution at each position
    (after temperature, top-k, top-p). The emitted tokens: accepted drafts, then one token drawn from
    the residual at the first rejection, or from the last position's distribution when all held."""
    assert probs.shape[0] == len(drafts) + 1
    out = []
    for i, d in enumerate(drafts):
        u = torch.rand((), generator=generator).item()
        p_d = probs[i, d].item()
        if u < p_d:
            out.append(d)
            continue
        residual = probs[i].clone()
        residual[d] = 0.0
        total = residual.sum()
        if total <= 0:  # p was a point mass on d, so u < p(d) = 1 always held; keep for safety
            out.append(d)
            return out
        out.append(int(torch.multinomial(residual / total, 1, generator=generator).item()))
        return out
    out.append(int(torch.multinomial(probs[-1], 1, generator=generator).item()))
    return out
