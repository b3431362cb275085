"""The host half of device sampling: each request's parameters checked and laid out as per-slot
tensors (one entry per logits row, or per request where only its first row needs it), grammar
bitmasks filled, everything queued for one upload.

A request whose own parameters cannot be used gets an error naming the parameter here, before any
device work: its rows then take part in nothing (no edit, no draw), and the others are unaffected.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import torch

from engine.request import Request
from engine.sampling.noise import seed_words
from engine.sampling.upload import HostBatch

# Requests built without an engine (no `sample_seed`, no `params.seed`) still need a key: each gets
# the next of these once and keeps it.
_fallback_seeds = itertools.count(0x5EED_0000_0000)


@dataclass(slots=True)
class SamplingPlan:
    """What one step's sampling does, decided on the host. `*_rows`: logits rows; the device tensors
    are named in `names` (see `build_plan` for each one's meaning)."""

    num_rows: int
    vocab: int
    starts: list[int]
    drafts: list[list[int]]
    errors: dict[int, str]
    sampled_rows: list[int] = field(default_factory=list)  # the rows of requests drawn at random
    any_greedy: bool = False  # some request takes the argmax
    wants: list[int] = field(default_factory=list)  # requests with logprobs
    logprobs_k: int = 0
    constrained: list[tuple[int, object]] = field(default_factory=list)  # (request, grammar state)
    any_min_p: bool = False
    top_k_max: int = 0  # the largest top_k in force (0: none)
    top_p_rows: list[int] = field(default_factory=list)  # positions in sampled_rows with top_p < 1
    # per sampled row: (temperature, top_k, top_p, min_p, seed_lo, seed_hi, position, draft)
    row_params: list[tuple] = field(default_factory=list)
    any_repetition: bool = False
    any_counts: bool = False  # frequency or presence penalties with output so far
    names: dict[str, int] = field(default_factory=dict)
    batch: HostBatch = field(default_factory=HostBatch)

    def add(self, name: str, values: list | torch.Tensor, dtype: torch.dtype) -> None:
        t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
        self.names[name] = self.batch.add(t.to(dtype))

    def upload(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Every queued tensor on `device`, in one transfer."""
        tensors = self.batch.upload(device)
        return {name: tensors[i] for name, i in self.names.items()}


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check_ids(ids, vocab: int, field_name: str) -> None:
    bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
    if bad:
        raise ValueError(f"{field_name}: token ids must be in [0, {vocab}), got {bad[:4]}")


def _check(req: Request, vocab: int, banned: list[int]) -> None:
    """ValueError naming the parameter if this request's rows cannot be sampled as asked."""
    p = req.params
    if not p.greedy:
        if not _finite(p.temperature) or p.temperature <= 0:
            raise ValueError(f"temperature: must be a finite number > 0, got {p.temperature!r}")
        if not _finite(p.top_p) or not 0 < p.top_p <= 1:
            raise ValueError(f"top_p: must be a number in (0, 1], got {p.top_p!r}")
        if not isinstance(p.top_k, int) or p.top_k < -1:
            raise ValueError(f"top_k: must be -1, 0 or a positive integer, got {p.top_k!r}")
        if not _finite(p.min_p) or not 0 <= p.min_p <= 1:
            raise ValueError(f"min_p: must be a number in [0, 1], got {p.min_p!r}")
    if p.has_penalties:
        if not _finite(p.repetition_penalty) or p.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty: must be a finite number > 0, got {p.repetition_penalty!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not _finite(getattr(p, name)):
                raise ValueError(f"{name}: must be a finite number, got {getattr(p, name)!r}")
        if p.logit_bias:
            _check_ids(list(p.logit_bias), vocab, "logit_bias")
            if not all(_finite(v) for v in p.logit_bias.values()):
                raise ValueError("logit_bias: values must be finite numbers")
        if p.repetition_penalty != 1.0:
            _check_ids(req.all_token_ids, vocab, "prompt")
    if banned:
        _check_ids(p.stop_token_ids, vocab, "stop_token_ids")
        _check_ids(banned, vocab, "min_tokens (end-of-sequence ids)")


def _banned(req: Request, row: int, eos_token_ids: frozenset[int]) -> list[int]:
    """The ids min_tokens bans at the request's `row`-th row (its output then has `row` more tokens)."""
    p = req.params
    if len(req.output_token_ids) + row >= p.min_tokens:
        return []
    return list(p.stop_token_ids) + ([] if p.ignore_eos else sorted(eos_token_ids))


def _seed(req: Request) -> int:
    if req.sample_seed is None:
        req.sample_seed = req.params.seed if req.params.seed is not None else next(_fallback_seeds)
    return req.sample_seed


def build_plan(requests: list[Request], drafts: list[list[int]], eos_token_ids: frozenset[int],
               num_rows: int, vocab: int) -> SamplingPlan:
    """Check every request and queue its per-slot tensors (see the names below)."""
    starts, r = [], 0
    for d in drafts:
        starts.append(r)
        r += 1 + len(d)
    assert r == num_rows, f"{num_rows} logit rows for {r} positions"
    plan = SamplingPlan(num_rows, vocab, starts, drafts, errors={})
    bias_idx, bias_val, ban_idx = [], [], []
    pen_rows, rep, freq, pres, seen, counted = [], [], [], [], [], []
    grammar = []
    for i, req in enumerate(requests):
        p, r0, n = req.params, starts[i], len(drafts[i]) + 1
        bans = [_banned(req, j, eos_token_ids) for j in range(n)]
        try:
            _check(req, vocab, [t for b in bans for t in b])
        except ValueError as exc:
            plan.errors[i] = str(exc)
            continue
        for j, b in enumerate(bans):
            ban_idx.extend((r0 + j) * vocab + t for t in b)
        if p.has_penalties:
            for t, v in (p.logit_bias or {}).items():
                bias_idx.append(r0 * vocab + t)
                bias_val.append(v)
            generated = req.generated_ids
            if p.repetition_penalty != 1.0 or ((p.frequency_penalty or p.presence_penalty) and generated):
                pen_rows.append(r0)
                rep.append(p.repetition_penalty)
                freq.append(p.frequency_penalty)
                pres.append(p.presence_penalty)
                seen.append(req.all_token_ids if p.repetition_penalty != 1.0 else [])
                counted.append(generated if (p.frequency_penalty or p.presence_penalty) else [])
        if req.grammar is not None:
            grammar.append((i, r0, req.grammar))
        if p.logprobs is not None:
            plan.wants.append(i)
        if p.greedy:
            plan.any_greedy = True
        else:
            _add_sampled_rows(plan, req, r0, drafts[i])
    # NOTE: only what some row uses is queued (the device ops test which names are there): a plain
    # greedy batch uploads nothing.
    if plan.sampled_rows:
        _queue_sampling(plan)
    _queue_edits(plan, bias_idx, bias_val, ban_idx)
    if pen_rows:
        _queue_penalties(plan, pen_rows, rep, freq, pres, seen, counted)
    if grammar:
        _queue_grammar(plan, grammar)
    if plan.wants:
        plan.add("logprob_rows", [starts[i] for i in plan.wants], torch.long)
        plan.logprobs_k = min(vocab, max(requests[i].params.logprobs for i in plan.wants))
    return plan


def _add_sampled_rows(plan: SamplingPlan, req: Request, r0: int, drafts: list[int]) -> None:
    p, vocab = req.params, plan.vocab
    lo, hi = seed_words(_seed(req))
    top_k = p.top_k if 0 < p.top_k < vocab else 0
    for j in range(len(drafts) + 1):
        d = drafts[j] if j < len(drafts) else -1
        plan.sampled_rows.append(r0 + j)
        # An id outside the vocabulary has probability 0: rejected, never drawn (-1: no draft).
        plan.row_params.append((p.temperature, top_k, p.top_p, p.min_p, lo, hi, req.num_tokens + j,
                                d if 0 <= d < vocab else -1))
    plan.any_min_p |= p.min_p > 0
    plan.top_k_max = max(plan.top_k_max, top_k)


def _queue_sampling(plan: SamplingPlan) -> None:
    """sampled_rows [S]; temperature, top_p, min_p fp32 [S]; top_k [S] (0: off); seed_lo, seed_hi,
    position [S]: the noise's key; draft [S]: the token a row verifies (-1: none, it draws freely);
    top_p_rows: positions in sampled_rows with top_p < 1 (sorted only those)."""
    cols = list(zip(*plan.row_params)) or [()] * 8
    plan.add("sampled_rows", plan.sampled_rows, torch.long)
    for name, values in zip(("temperature", "top_k", "top_p", "min_p", "seed_lo", "seed_hi", "position", "draft"),
                            cols):
        plan.add(name, list(values), torch.float32 if name in ("temperature", "top_p", "min_p") else torch.long)
    plan.top_p_rows = [s for s, row in enumerate(plan.row_params) if row[2] < 1.0]
    plan.add("top_p_rows", plan.top_p_rows, torch.long)


def _queue_edits(plan: SamplingPlan, bias_idx: list[int], bias_val: list[float], ban_idx: list[int]) -> None:
    """(Each only if not empty.) bias_idx, bias_val: flat (row * vocab + token) indices into the logits
    and the values added; ban_idx: flat indices set to -inf (min_tokens)."""
    if bias_idx:
        plan.add("bias_idx", bias_idx, torch.long)
        plan.add("bias_val", bias_val, torch.float32)
    if ban_idx:
        plan.add("ban_idx", ban_idx, torch.long)


def _padded(lists: list[list[int]], pad: int) -> torch.Tensor:
    width = max((len(x) for x in lists), default=0)
    out = torch.full((len(lists), max(width, 1)), pad, dtype=torch.long)
    for r, x in enumerate(lists):
        if x:
            out[r, :len(x)] = torch.tensor(x, dtype=torch.long)
    return out


def _queue_penalties(plan: SamplingPlan, rows: list[int], rep: list[float], freq: list[float], pres: list[float],
                     seen: list[list[int]], counted: list[list[int]]) -> None:
    """penalty_rows [P]; repetition, frequency, presence fp32 [P]; seen_ids [P, L]: the prompt and
    output tokens a repetition penalty applies to; counted_ids [P, L']: the generated tokens counted
    by frequency/presence; both padded with `vocab` (a column past the end, dropped)."""
    plan.any_repetition = any(x for x in seen)
    plan.any_counts = any(x for x in counted)
    plan.add("penalty_rows", rows, torch.long)
    plan.add("repetition", rep, torch.float32)
    plan.add("frequency", freq, torch.float32)
    plan.add("presence", pres, torch.float32)
    plan.add("seen_ids", _padded(seen if plan.any_repetition else [], plan.vocab), torch.long)
    plan.add("counted_ids", _padded(counted if plan.any_counts else [], plan.vocab), torch.long)


def _queue_grammar(plan: SamplingPlan, grammar: list[tuple[int, int, object]]) -> None:
    """grammar_rows [C]; bitmask int32 [C, ceil(vocab / 32)] (xgrammar's layout: bit t % 32 of word
    t // 32 set = token t allowed); give_back_row, give_back_token [G]: the stop tokens a row gets
    back if it is left with no token (`engine.structured._give_back_the_end`), its index in C (only if any)."""
    gb_row, gb_tok = [], []
    # All bits set (every token allowed): xgrammar.allocate_token_bitmask's layout, made here so that
    # only the matchers need xgrammar.
    bitmask = torch.full((len(grammar), -(-plan.vocab // 32)), -1, dtype=torch.int32)
    for c, (i, _, state) in enumerate(grammar):
        try:
            state.fill_mask(bitmask, c)
        except (RuntimeError, ValueError):  # one request's matcher: its own failure
            plan.errors[i] = "structured output: the grammar matcher failed"
            continue
        plan.constrained.append((i, state))
        if state.bans_stops and state.matcher.is_completed():
            for t in state.matcher.stop_token_ids:
                if 0 <= t < plan.vocab:
                    gb_row.append(c)
                    gb_tok.append(t)
    plan.add("grammar_rows", [r0 for _, r0, _ in grammar], torch.long)
    plan.add("bitmask", bitmask, torch.int32)
    if gb_row:
        plan.add("give_back_row", gb_row, torch.long)
        plan.add("give_back_token", gb_tok, torch.long)
