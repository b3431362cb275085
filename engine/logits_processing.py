"""Per-request edits of a logits row before sampling: logit_bias, then the repetition, frequency and
presence penalties (vLLM's order). Only rows whose request asks for one of them are touched.

- logit_bias: `logit[t] += bias[t]` (OpenAI).
- repetition_penalty r (transformers' RepetitionPenaltyLogitsProcessor, vLLM): every token seen in the
  prompt or the output so far: `logit / r` if the logit is positive, else `logit * r`.
- frequency_penalty f, presence_penalty p (OpenAI): over the output so far,
  `logit[t] -= f * count[t] + p * (count[t] > 0)`.
"""

from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams


def apply_penalties(row: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int]) -> None:
    """Edit one fp32 logits row [vocab] in place for `params`' bias and penalties."""
    dev = row.device
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), device=dev)
        row.index_add_(0, ids, torch.tensor(list(params.logit_bias.values()), dtype=row.dtype, device=dev))
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(prompt_ids + output_ids, device=dev).unique()
        r = params.repetition_penalty
        s = row[seen]
        row[seen] = torch.where(s > 0, s / r, s * r)
    if (params.frequency_penalty or params.presence_penalty) and output_ids:
        ids, counts = torch.tensor(output_ids, device=dev).unique(return_counts=True)
        row[ids] -= params.frequency_penalty * counts.to(row.dtype) + params.presence_penalty


def apply_min_p(row: torch.Tensor, min_p: float) -> torch.Tensor:
    """`row` (logits after temperature) with every token whose probability is below `min_p` x the top
    token's set to -inf (transformers' MinPLogitsWarper; the top token always stays)."""
    probs = torch.softmax(row, dim=-1)
    return row.masked_fill(probs < min_p * probs.max(), float("-inf"))
