"""Per-request sampling within one batch: greedy, temperature, top-k, top-p, seeded generators."""

from __future__ import annotations

import torch

from engine import cpu_kernels
from engine.request import Request


def sample(logits: torch.Tensor, requests: list[Request], eos_token_ids: frozenset[int]) -> list[int]:
    """logits: fp32 [len(requests), vocab]. Returns one token id per request.

    NOTE: random rows draw from each request's own generator, so a seeded request samples the same
    tokens whatever else shares its batch.
    """
    for i, req in enumerate(requests):
        p = req.params
        if len(req.output_token_ids) < p.min_tokens:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids))
            if banned:
                logits[i, banned] = float("-inf")
    greedy = cpu_kernels.argmax_rows(logits)  # None: not a CPU fp32 batch, or no compiled kernels
    token_ids = (logits.argmax(dim=-1) if greedy is None else greedy).tolist()
    for i, req in enumerate(requests):
        p = req.params
        if p.greedy:
            continue
        row = logits[i] / p.temperature
        if p.top_k > 0 and p.top_k < row.shape[0]:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(row, descending=True)
            probs = torch.softmax(sorted_logits, dim=-1)
            # Drop a token when the tokens above it already reach top_p (the top one always stays).
            drop = (probs.cumsum(-1) - probs) >= p.top_p
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            row = torch.full_like(row, float("-inf")).scatter(0, order, sorted_logits)
        # NOTE: per-request generators live on the CPU, so seeded draws match on any device.
        probs = torch.softmax(row, dim=-1).cpu()
        token_ids[i] = int(torch.multinomial(probs, 1, generator=req.generator).item())
    return token_ids
