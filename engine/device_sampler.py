"""Sampling on the logits' device (CPU or GPU, one design): the same contract as
`engine.sampler.sample` (which stays as the reference), with the work batched over the rows and
one device-to-host copy per step.

    host:   build_plan   per-slot parameter tensors, sparse bias/ban lists, grammar bitmasks
              | one upload (pinned, non-blocking on CUDA)
    device: raw logprobs -> edit_logits -> argmax | probs -> draw (race, drafts) -> pick_logprobs
              | pack: [emitted token per row, flags per row (if sampled), logprobs (if asked)]
    host:   read_back (the one copy) -> tokens per request, errors, grammar advance, TokenLogprobs

Rows that need no extra pay nothing extra: an all-greedy batch without edits or logprobs is one
argmax and one read.

NOTE (seeded outputs changed): a random draw is keyed by the request's seed and the position of the
token in its sequence (engine/sampling/noise.py: a counter-based integer hash, then the exponential
race argmax(p / E)), no longer by a per-request CPU `torch.Generator`. A seed now gives the same
tokens in any batch, in any row, after a move to another worker, and on CPU or GPU for the same
logits (a CPU and a GPU model's logits differ by rounding, and a near-tie of the race can then go
either way); it does not give the text the old generator gave. Requests without a seed get one from
the engine (`Request.sample_seed`, from `EngineConfig.seed`), as their generator's seed came before.
Speculative decoding keeps each token's distribution, not its draws (as before).

NOTE: a request can fail only itself. Its own unusable parameters are found on the host
(engine/sampling/plan.py) and its rows then take part in nothing; a row left with no token of
finite probability is flagged on the device and fails its request alone after the read.
"""

from __future__ import annotations

import torch

from engine.logprobs import raw_logprobs
from engine.request import Request, TokenLogprob
from engine.sampler import SampleResult
from engine.sampling.device_ops import (ACCEPTED, NO_DISTRIBUTION, argmax, draw, edit_logits, pick_logprobs,
                                        sampling_probs)
from engine.sampling.plan import SamplingPlan, build_plan
from engine.spec.verify import verify_greedy


def read_back(packed: torch.Tensor) -> torch.Tensor:
    """The step's one device-to-host copy: everything the host needs, packed in one int64 tensor.
    (The only place the sampler waits for the device; tests count its calls.)"""
    return packed.cpu()


def sample_on_device(logits: torch.Tensor, requests: list[Request], eos_token_ids: frozenset[int],
                     drafts: list[list[int]] | None = None) -> SampleResult:
    """The tokens each request appends this step, or an error for that request alone: the contract
    of `engine.sampler.sample` (logits [sum of 1 + len(drafts[i]), vocab], edited in place when
    they are contiguous fp32; structured requests' grammars advanced here)."""
    drafts = drafts if drafts is not None else [[] for _ in requests]
    if logits.dtype != torch.float32 or not logits.is_contiguous():
        logits = logits.float().contiguous()
    if not requests:
        return SampleResult([], {})
    plan = build_plan(requests, drafts, eos_token_ids, logits.shape[0], logits.shape[1])
    t = plan.upload(logits.device)
    raw = None
    if plan.wants:  # raw: before any edit
        raw = raw_logprobs(logits if len(plan.wants) == plan.num_rows else logits.index_select(0, t["logprob_rows"]))
    edit_logits(logits, t, plan)
    host = read_back(_pack(logits, raw, t, plan))
    return _compose(host, requests, plan)


def _pack(logits: torch.Tensor, raw: torch.Tensor | None, t: dict[str, torch.Tensor],
          plan: SamplingPlan) -> torch.Tensor:
    """int64: the token each row emits [rows], then (with sampled rows) each row's flags [rows], then
    (with logprobs) per such request its chosen token's logprob and top k (ids, logprobs) [L * (1 + 2k)]."""
    rows, dev = plan.num_rows, logits.device
    tokens = argmax(logits) if plan.any_greedy else torch.zeros(rows, dtype=torch.long, device=dev)
    parts = [tokens]
    if plan.sampled_rows:
        drawn, drawn_flags = draw(sampling_probs(logits, t, plan), t)
        if len(plan.sampled_rows) == rows:
            tokens, flags = drawn, drawn_flags
        else:
            tokens = tokens.index_copy(0, t["sampled_rows"], drawn)
            flags = torch.zeros(rows, dtype=torch.long, device=dev).index_copy_(0, t["sampled_rows"], drawn_flags)
        parts = [tokens, flags]
    if raw is not None:
        chosen = tokens.index_select(0, t["logprob_rows"])
        parts.append(pick_logprobs(raw, chosen, plan.logprobs_k).view(-1))
    return torch.cat(parts) if len(parts) > 1 else tokens


def _emitted(tokens: list[int], flags: list[int], r0: int, drafts: list[int]) -> list[int]:
    """A sampled request's tokens: its rows' tokens up to and including the first not accepted."""
    out = []
    for j in range(len(drafts) + 1):
        out.append(tokens[r0 + j])
        if not flags[r0 + j] & ACCEPTED:
            break
    return out


def _no_distribution(req: Request) -> str:
    """The error of a sampled request left with no token to draw, naming what masked tokens."""
    masks = [name for name, on in (("min_tokens", len(req.output_token_ids) < req.params.min_tokens),
                                   ("structured output", req.grammar is not None)) if on]
    return ("sampling failed: no token has a finite probability (non-finite logits"
            + (f", or every token masked by {' and '.join(masks)})" if masks else ")"))


def _compose(host: torch.Tensor, requests: list[Request], plan: SamplingPlan) -> SampleResult:
    rows = plan.num_rows
    tokens = host[:rows].tolist()
    flags = host[rows:2 * rows].tolist() if plan.sampled_rows else [0] * rows
    rest = host[(2 if plan.sampled_rows else 1) * rows:]
    errors = dict(plan.errors)
    token_ids: list[list[int]] = []
    for i, req in enumerate(requests):
        r0, d = plan.starts[i], plan.drafts[i]
        out: list[int] = []
        if i not in errors:
            if req.params.greedy:
                out = verify_greedy(tokens[r0:r0 + len(d) + 1], d) if d else [tokens[r0]]
            elif any(flags[r] & NO_DISTRIBUTION for r in range(r0, r0 + len(d) + 1)):
                errors[i] = _no_distribution(req)
            else:
                out = _emitted(tokens, flags, r0, d)
        if out and req.grammar is not None and not req.grammar.accept(out[0]):
            errors[i] = f"structured output: token {out[0]} is not allowed by the grammar"
            out = []
        token_ids.append(out)
    logprobs = _logprobs(rest, requests, plan, token_ids, errors) if plan.wants else None
    return SampleResult(token_ids, errors, logprobs or None)


def _logprobs(block: torch.Tensor, requests: list[Request], plan: SamplingPlan, token_ids: list[list[int]],
              errors: dict[int, str]) -> dict[int, list[TokenLogprob]]:
    k = plan.logprobs_k
    block = block.view(len(plan.wants), 1 + 2 * k)
    chosen = block[:, 0].to(torch.int32).view(torch.float32).tolist()
    ids = block[:, 1:1 + k].tolist()
    values = block[:, 1 + k:].contiguous().to(torch.int32).view(torch.float32).tolist()
    out = {}
    for j, i in enumerate(plan.wants):
        if i in errors:
            continue
        n = requests[i].params.logprobs
        out[i] = [TokenLogprob(token_ids[i][0], chosen[j], list(zip(ids[j][:n], values[j][:n])))]
    return out
