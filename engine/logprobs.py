"""Logprobs of chosen tokens and their top alternatives, from fp32 logits rows.

Values are raw: log_softmax of the model's logits, before temperature, penalties, biases or grammar
masks (vLLM's default). Top alternatives are ordered best first, ties by token id.
"""

from __future__ import annotations

import torch

from engine.request import Request, RequestOutput, TokenLogprob


def _top_k(lp: torch.Tensor, k: int) -> list[list[tuple[int, float]]]:
    """Per row of log-probabilities `lp` [n, vocab], its k best (token id, logprob), ties by lower id.

    NOTE: one batched topk of k + 1 serves every row without a tie among its k + 1 best (the usual
    case: fp32 logits rarely tie); only a row with a tie is redone exactly, alone."""
    n = lp.shape[0]
    if k <= 0 or n == 0:
        return [[] for _ in range(n)]
    vals, ids = torch.topk(lp, min(k + 1, lp.shape[1]), dim=-1)
    tied = (vals[:, 1:] == vals[:, :-1]).any(dim=-1).tolist()
    vals_k, ids_k = vals[:, :k].tolist(), ids[:, :k].tolist()
    return [_top_k_tied(lp[r], k) if tied[r] else list(zip(ids_k[r], vals_k[r])) for r in range(n)]


def _top_k_tied(row: torch.Tensor, k: int) -> list[tuple[int, float]]:
    """One row's k best, ties by lower id: every token at least as good as the k-th, in id order, then a
    stable sort by value."""
    kth = torch.topk(row, k).values[-1]
    ids = (row >= kth).nonzero().view(-1)  # ascending ids
    order = torch.sort(row[ids], descending=True, stable=True).indices[:k]
    return list(zip(ids[order].tolist(), row[ids[order]].tolist()))


def token_logprobs(logits: torch.Tensor, token_ids: list[int], k: int) -> list[TokenLogprob]:
    """`logits` [n, vocab] (any float dtype; computed in fp32); row i scores `token_ids[i]`."""
    return pick(raw_logprobs(logits), token_ids, k)


def raw_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """log_softmax of logits rows in fp32 (a copy: the sampler then edits the logits in place)."""
    return torch.log_softmax(logits.float(), dim=-1)


def pick(lp: torch.Tensor, token_ids: list[int], k: int) -> list[TokenLogprob]:
    """TokenLogprobs from rows already through `raw_logprobs`: row i scores `token_ids[i]`."""
    chosen = lp.gather(1, torch.tensor(token_ids, device=lp.device).view(-1, 1)).view(-1).tolist()
    return [TokenLogprob(t, v, top) for t, v, top in zip(token_ids, chosen, _top_k(lp, k))]


def record_prompt_logprobs(chunks: list, prompt: dict[int, list[TokenLogprob]]) -> None:
    """Store a step's prompt logprobs (`StepLogits.prompt_logprobs`) on their requests, by position.
    Call before the chunks are committed: a chunk starts at its request's `num_computed_tokens`."""
    for ci, lps in prompt.items():
        req = chunks[ci].request
        if req.prompt_logprobs is None:
            req.prompt_logprobs = [None] * req.num_prompt_tokens
        start = req.num_computed_tokens + 1
        req.prompt_logprobs[start:start + len(lps)] = lps


def attach_logprobs(out: RequestOutput, req: Request, sampled: list[TokenLogprob] | None) -> RequestOutput:
    """Put the logprobs `req` asked for on its output: those of `out.new_token_ids` (`sampled`: the
    sampler's, one per drawn token, a stop token's included), and its prompt's on the first output."""
    p = req.params
    if p.logprobs is not None:
        out.logprobs = list(sampled or [])[:len(out.new_token_ids)]
    if p.prompt_logprobs is not None and not req.prompt_logprobs_sent:
        out.prompt_logprobs = req.prompt_logprobs or [None] * req.num_prompt_tokens
        req.prompt_logprobs, req.prompt_logprobs_sent = None, True
    return out
