"""The device half of sampling: batched edits of the logits (bias, penalties, min_tokens bans,
grammar masks), the draws (argmax; temperature, min-p, top-k, top-p and the exponential race; the
acceptance of drafts) and the logprobs. Every op takes the step's uploaded tensors (`plan.upload`)
and only host-known sizes: nothing here reads a device value back.
"""

from __future__ import annotations

import torch

from engine import cpu_kernels
from engine.sampling.noise import STREAM_ACCEPT, STREAM_DRAW, exponentials, row_keys, uniforms
from engine.sampling.plan import SamplingPlan

NEG_INF = float("-inf")
ACCEPTED, NO_DISTRIBUTION = 1, 2  # flag bits of a sampled row
_SHIFTS: dict[str, torch.Tensor] = {}


def edit_logits(logits: torch.Tensor, t: dict[str, torch.Tensor], plan: SamplingPlan) -> None:
    """In place, in the reference's order: logit_bias, repetition/frequency/presence penalties,
    min_tokens bans, grammar masks (with `_give_back_the_end`)."""
    flat = logits.view(-1)
    if "bias_idx" in t:
        flat.index_add_(0, t["bias_idx"], t["bias_val"])
    if plan.any_repetition or plan.any_counts:
        _penalize(logits, t, plan)
    if "ban_idx" in t:
        flat.index_fill_(0, t["ban_idx"], NEG_INF)
    if plan.constrained:
        _mask_grammar(logits, t, plan.vocab)


def _penalize(logits: torch.Tensor, t: dict[str, torch.Tensor], plan: SamplingPlan) -> None:
    rows, vocab = t["penalty_rows"], plan.vocab
    x = logits.index_select(0, rows)
    if plan.any_repetition:
        # NOTE: ids are padded with `vocab`, a column past the end that is cut off again.
        seen = torch.zeros(x.shape[0], vocab + 1, dtype=torch.bool, device=x.device)
        seen = seen.scatter_(1, t["seen_ids"], True)[:, :vocab]
        r = t["repetition"].unsqueeze(1)
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    if plan.any_counts:
        ids = t["counted_ids"]
        counts = torch.zeros(x.shape[0], vocab + 1, dtype=x.dtype, device=x.device)
        counts = counts.scatter_add_(1, ids, torch.ones(ids.shape, dtype=x.dtype, device=x.device))[:, :vocab]
        x = x - (t["frequency"].unsqueeze(1) * counts + t["presence"].unsqueeze(1) * (counts > 0))
    logits.index_copy_(0, rows, x)


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """xgrammar's packed int32 bitmask [n, ceil(vocab / 32)] as bool [n, vocab] (True: allowed)."""
    key = str(bitmask.device)
    if key not in _SHIFTS:
        _SHIFTS[key] = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> _SHIFTS[key]) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab].bool()


def _mask_grammar(logits: torch.Tensor, t: dict[str, torch.Tensor], vocab: int) -> None:
    rows = t["grammar_rows"]
    x = logits.index_select(0, rows)
    allowed = unpack_bitmask(t["bitmask"], vocab)
    x.masked_fill_(~allowed, NEG_INF)
    if "give_back_row" in t:
        # A row the mask and min_tokens' bans left empty gets the stop tokens its grammar allows:
        # decided on the device (no read of which rows are empty), a no-op for the others.
        c = t["give_back_row"]
        idx = c * vocab + t["give_back_token"]
        dead = x.amax(dim=-1) == NEG_INF
        now = x.view(-1).index_select(0, idx)
        back = dead.index_select(0, c) & allowed.reshape(-1).index_select(0, idx)
        x.view(-1).index_copy_(0, idx, torch.where(back, torch.zeros_like(now), now))
    logits.index_copy_(0, rows, x)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """The first maximum of each row (int64 [rows])."""
    out = cpu_kernels.argmax_rows(logits)  # None: not a CPU fp32 batch, or no compiled kernels
    return logits.argmax(dim=-1) if out is None else out


def sampling_probs(logits: torch.Tensor, t: dict[str, torch.Tensor], plan: SamplingPlan) -> torch.Tensor:
    """The sampled rows' distributions [S, vocab], as `engine.sampler.row_probs` computes them one
    row at a time: temperature, then min-p, top-k, top-p (each only if some row asks for it)."""
    x = logits if len(plan.sampled_rows) == plan.num_rows else logits.index_select(0, t["sampled_rows"])
    x = x / t["temperature"].unsqueeze(1)
    if plan.any_min_p:
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < t["min_p"].unsqueeze(1) * probs.amax(dim=-1, keepdim=True), NEG_INF)
    if plan.top_k_max:
        k = t["top_k"].unsqueeze(1)
        kth = torch.topk(x, plan.top_k_max, dim=-1).values.gather(1, (k - 1).clamp(min=0))
        x = x.masked_fill((x < kth) & (k > 0), NEG_INF)
    if plan.top_p_rows:
        x = _top_p(x, t, len(plan.top_p_rows) == len(plan.sampled_rows))
    return torch.softmax(x, dim=-1)


def _top_p(x: torch.Tensor, t: dict[str, torch.Tensor], every_row: bool) -> torch.Tensor:
    idx = t["top_p_rows"]
    sub = x if every_row else x.index_select(0, idx)
    top_p = t["top_p"] if every_row else t["top_p"].index_select(0, idx)
    sorted_logits, order = torch.sort(sub, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    # Drop a token when the tokens above it already reach top_p; the top token always stays.
    drop = (probs.cumsum(dim=-1) - probs) >= top_p.unsqueeze(1)
    drop[:, 0] = False
    sub = torch.full_like(sub, NEG_INF).scatter_(1, order, sorted_logits.masked_fill(drop, NEG_INF))
    return sub if every_row else x.index_copy(0, idx, sub)


def draw(probs: torch.Tensor, t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sampled row, the token it emits and its flags (ACCEPTED, NO_DISTRIBUTION), int64 [S] each.

    A row without a draft draws argmax(p / E) with E exponentials keyed by (seed, position, token):
    the exponential race, distributed as p. A row verifying draft d accepts it when a uniform keyed by
    (seed, position) is below p(d) (the point-mass proposal's rule, engine/spec/verify.py), and
    otherwise draws the same race with d left out: p without d, renormalized."""
    vocab = probs.shape[1]
    draft = t["draft"]
    keys = row_keys(t["seed_lo"], t["seed_hi"], t["position"], STREAM_DRAW)
    race = probs / exponentials(keys, vocab)
    has = draft >= 0
    col = draft.clamp(min=0).unsqueeze(1)
    race.scatter_(1, col, torch.where(has.unsqueeze(1), torch.zeros_like(col, dtype=race.dtype), race.gather(1, col)))
    best, token = race.max(dim=-1)
    token = torch.where(has & (best <= 0), draft, token)  # p was all on d: kept for safety, never rejected
    u = uniforms(row_keys(t["seed_lo"], t["seed_hi"], t["position"], STREAM_ACCEPT))
    accepted = has & (u < probs.gather(1, col).squeeze(1))
    token = torch.where(accepted, draft, token)
    bad = ~(torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0))
    return token, accepted.long() * ACCEPTED + bad.long() * NO_DISTRIBUTION


def _order_key(lp: torch.Tensor) -> torch.Tensor:
    """int64 keys ordered as (value descending, token id ascending): the float's bits made monotone
    in the high 32 bits, the id reversed in the low 32, so topk has no ties to break."""
    bits = (lp + 0.0).view(torch.int32).to(torch.int64)  # + 0.0: -0.0 ties +0.0
    bits = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    ids = torch.arange(lp.shape[1], dtype=torch.int64, device=lp.device)
    return bits * (1 << 32) + ((1 << 32) - 1 - ids)


def float_bits(x: torch.Tensor) -> torch.Tensor:
    """fp32 values as int64 holding their bits (to travel in the int64 read-back)."""
    return x.contiguous().view(torch.int32).to(torch.int64)


def pick_logprobs(raw: torch.Tensor, chosen: torch.Tensor, k: int) -> torch.Tensor:
    """Per row of raw logprobs [L, vocab]: [chosen token's logprob, k top ids, k top logprobs] as
    int64 [L, 1 + 2k] (logprobs as fp32 bits). Top: best first, ties by lower id (engine/logprobs.py)."""
    parts = [float_bits(raw.gather(1, chosen.unsqueeze(1)))]
    if k:
        ids = torch.topk(_order_key(raw), min(k, raw.shape[1]), dim=-1).indices
        parts += [ids, float_bits(raw.gather(1, ids))]
    return torch.cat(parts, dim=1)
