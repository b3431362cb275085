"""Per-request sampling within one batch: greedy, temperature, top-k, top-p, min-p, seeded generators,
and the verification of speculative drafts (the same row processing gives the distributions both draw from).

A row goes through: raw logprobs (if asked, before any edit) -> logit_bias and penalties (if asked) ->
min_tokens bans -> grammar mask (structured requests) -> greedy argmax, or temperature, min-p, top-k,
top-p and the draw -> the grammar advanced over the token. Rows that ask for none of these extras pay
nothing for them.

NOTE: a request can fail only itself. The work each row does for its own request (min_tokens bans,
penalties, grammar masks and advances, temperature, top-k/top-p, the draw, logprobs) runs row by row
under its own guard: a row that fails is reported in `SampleResult.errors` and the engine ends that
request alone; the other rows keep their tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine import cpu_kernels
from engine.logits_processing import apply_min_p, apply_penalties
from engine.logprobs import pick, raw_logprobs
from engine.request import Request, TokenLogprob
from engine.sampling_params import SamplingParams
from engine.structured import apply_masks
from engine.spec.verify import verify_greedy, verify_sampled


class SampleResult(NamedTuple):
    # Per request, the tokens to append in order: one, or (with drafts) the accepted drafts and one
    # token of the model's own; [] where the row failed.
    token_ids: list[list[int]]
    errors: dict[int, str]  # request index -> what went wrong, naming the parameter where one is to blame
    # request index -> the logprobs of its tokens (requests with params.logprobs only)
    logprobs: dict[int, list[TokenLogprob]] | None = None


def _ban_stops_before_min_tokens(logits: torch.Tensor, row: int, req: Request, num_output: int,
                                 eos_token_ids: frozenset[int]) -> None:
    """`num_output`: the request's output length when this row's token is appended."""
    p = req.params
    if num_output < p.min_tokens:
        banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids))
        if banned:
            logits[row, banned] = float("-inf")


def row_probs(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampled request draws from at one position: softmax after its temperature,
    top-k and top-p, on the CPU. ValueError when no token has a finite probability."""
    row = row / params.temperature
    if params.min_p > 0:
        row = apply_min_p(row, params.min_p)
    if 0 < params.top_k < row.shape[0]:
        kth = torch.topk(row, params.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(row, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens above it already reach top_p (the top one always stays).
        drop = (probs.cumsum(-1) - probs) >= params.top_p
        drop[0] = False  # the top token always stays: a top_p that rounds to 0 in fp32 must not empty the row
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        row = torch.full_like(row, float("-inf")).scatter(0, order, sorted_logits)
    # NOTE: per-request generators live on the CPU, so seeded draws match on any device.
    probs = torch.softmax(row, dim=-1).cpu()
    if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0:
        raise ValueError("no token has a finite probability (non-finite logits, or every token masked)")
    return probs


def _draw(logits: torch.Tensor, r0: int, req: Request, drafts: list[int]) -> list[int]:
    """A sampled request's tokens from its rows r0 .. r0 + len(drafts)."""
    if not drafts:
        return [int(torch.multinomial(row_probs(logits[r0], req.params), 1, generator=req.generator).item())]
    probs = torch.stack([row_probs(logits[r0 + j], req.params) for j in range(len(drafts) + 1)])
    return verify_sampled(probs, drafts, req.generator)


def _prepare_rows(logits: torch.Tensor, requests: list[Request], starts: list[int], drafts: list[list[int]],
                  eos_token_ids: frozenset[int], errors: dict[int, str]) -> tuple[list[int], torch.Tensor | None]:
    """Edit each request's rows in place before the draw (bias, penalties, min_tokens bans, grammar
    masks). Returns the requests that ask for logprobs and their rows' raw logprobs, taken (in one
    batch) before any edit."""
    wants = [i for i, req in enumerate(requests) if req.params.logprobs is not None]
    rows = [starts[i] for i in wants]
    raw = None if not wants else raw_logprobs(logits if len(rows) == logits.shape[0] else logits[rows])
    constrained: list[int] = []
    for i, req in enumerate(requests):
        p = req.params
        try:
            if p.has_penalties:  # such requests never carry drafts (SamplingParams.can_speculate)
                apply_penalties(logits[starts[i]], p, req.original_prompt_ids, req.generated_ids)
            for j in range(len(drafts[i]) + 1):
                _ban_stops_before_min_tokens(logits, starts[i] + j, req, len(req.output_token_ids) + j, eos_token_ids)
        except (IndexError, RuntimeError, ValueError) as exc:
            errors[i] = f"logit_bias/penalties/min_tokens/stop_token_ids: {exc}"
            continue
        if req.grammar is not None:
            constrained.append(i)
    if constrained:
        failed = apply_masks(logits, [starts[i] for i in constrained], [requests[i].grammar for i in constrained])
        for f in failed:
            errors[constrained[f]] = "structured output: the grammar matcher failed"
    return wants, raw


def _pick_logprobs(requests: list[Request], wants: list[int], raw: torch.Tensor, token_ids: list[list[int]],
                   errors: dict[int, str]) -> dict[int, list[TokenLogprob]]:
    """The drawn tokens' logprobs (with their top alternatives) of the requests that ask, in one batch."""
    ok = [j for j, i in enumerate(wants) if i not in errors]
    if not ok:
        return {}
    k = max(requests[wants[j]].params.logprobs for j in ok)
    picked = pick(raw[ok], [token_ids[wants[j]][0] for j in ok], k)
    out = {}
    for j, entry in zip(ok, picked):
        i = wants[j]
        out[i] = [entry._replace(top=entry.top[:requests[i].params.logprobs])]
    return out


def sample(logits: torch.Tensor, requests: list[Request], eos_token_ids: frozenset[int],
           drafts: list[list[int]] | None = None) -> SampleResult:
    """The tokens each request appends this step, or an error for that request alone.

    logits: fp32 [sum over requests of 1 + len(drafts[i]), vocab]: each request's rows in order, one
    per position (its drafts' positions, then the one after the last). `drafts`: per request, the
    drafted tokens to verify (None: no drafts). Structured requests' grammars are advanced here.

    NOTE: random rows draw from each request's own generator, so a seeded request samples the same
    tokens whatever else shares its batch.
    """
    drafts = drafts if drafts is not None else [[] for _ in requests]
    starts, r = [], 0
    for d in drafts:
        starts.append(r)
        r += 1 + len(d)
    assert r == logits.shape[0], f"{logits.shape[0]} logit rows for {r} positions"
    errors: dict[int, str] = {}
    wants, raw = _prepare_rows(logits, requests, starts, drafts, eos_token_ids, errors)
    greedy = cpu_kernels.argmax_rows(logits)  # None: not a CPU fp32 batch, or no compiled kernels
    argmax = (logits.argmax(dim=-1) if greedy is None else greedy).tolist()
    token_ids: list[list[int]] = []
    for i, req in enumerate(requests):
        r0, d = starts[i], drafts[i]
        if i in errors:
            token_ids.append([])
            continue
        try:
            if req.params.greedy:
                tokens = verify_greedy(argmax[r0:r0 + len(d) + 1], d) if d else [argmax[r0]]
            else:
                tokens = _draw(logits, r0, req, d)
            if req.grammar is not None and not req.grammar.accept(tokens[0]):
                raise ValueError(f"structured output: token {tokens[0]} is not allowed by the grammar")
            token_ids.append(tokens)
        except (IndexError, RuntimeError, ValueError) as exc:
            errors[i] = str(exc) if str(exc).startswith("structured") else f"sampling failed: {exc}"
            token_ids.append([])
    logprobs = _pick_logprobs(requests, wants, raw, token_ids, errors) if wants else None
    return SampleResult(token_ids, errors, logprobs or None)
