"""Per-request sampling within one batch: greedy, temperature, top-k, top-p, seeded generators.

NOTE: a request can fail only itself. The work each row does for its own request (min_tokens bans,
temperature, top-k/top-p, the draw) runs row by row under its own guard: a row that fails is reported
in `SampleResult.errors` and the engine ends that request alone; the other rows keep their tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine import cpu_kernels
from engine.request import Request

NO_TOKEN = -1  # the token of a row that failed


class SampleResult(NamedTuple):
    token_ids: list[int]  # one per request; NO_TOKEN where the row failed
    errors: dict[int, str]  # row -> what went wrong, naming the parameter where one is to blame


def _ban_stops_before_min_tokens(logits: torch.Tensor, i: int, req: Request, eos_token_ids: frozenset[int]) -> None:
    p = req.params
    if len(req.output_token_ids) < p.min_tokens:
        banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids))
        if banned:
            logits[i, banned] = float("-inf")


def _sample_row(row: torch.Tensor, req: Request) -> int:
    p = req.params
    row = row / p.temperature
    if 0 < p.top_k < row.shape[0]:
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(row, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens above it already reach top_p (the top one always stays).
        drop = (probs.cumsum(-1) - probs) >= p.top_p
        drop[0] = False  # the top token always stays: a top_p that rounds to 0 in fp32 must not empty the row
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        row = torch.full_like(row, float("-inf")).scatter(0, order, sorted_logits)
    # NOTE: per-request generators live on the CPU, so seeded draws match on any device.
    probs = torch.softmax(row, dim=-1).cpu()
    if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0:
        raise ValueError("no token has a finite probability (non-finite logits, or every token masked)")
    return int(torch.multinomial(probs, 1, generator=req.generator).item())


def sample(logits: torch.Tensor, requests: list[Request], eos_token_ids: frozenset[int]) -> SampleResult:
    """logits: fp32 [len(requests), vocab]. One token id per request, or an error for that row alone.

    NOTE: random rows draw from each request's own generator, so a seeded request samples the same
    tokens whatever else shares its batch.
    """
    errors: dict[int, str] = {}
    for i, req in enumerate(requests):
        try:
            _ban_stops_before_min_tokens(logits, i, req, eos_token_ids)
        except (IndexError, RuntimeError, ValueError) as exc:
            errors[i] = f"min_tokens/stop_token_ids: {exc}"
    greedy = cpu_kernels.argmax_rows(logits)  # None: not a CPU fp32 batch, or no compiled kernels
    token_ids = (logits.argmax(dim=-1) if greedy is None else greedy).tolist()
    for i, req in enumerate(requests):
        if i in errors:
            token_ids[i] = NO_TOKEN
        elif not req.params.greedy:
            try:
                token_ids[i] = _sample_row(logits[i], req)
            except (IndexError, RuntimeError, ValueError) as exc:
                errors[i], token_ids[i] = f"sampling failed: {exc}", NO_TOKEN
    return SampleResult(token_ids, errors)
