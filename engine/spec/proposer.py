"""What a proposer is: something that guesses a sequence's next tokens from what it has seen."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from engine.config import SPECULATIVE_METHODS


@runtime_checkable
class Proposer(Protocol):
    """Guesses the next tokens of running sequences. Model-free proposers (n-gram, suffix) only look at
    token ids; a draft model would run its own small engine behind the same three calls.

    `propose` may return fewer than `max_tokens` drafts (none: no guess worth verifying). Each draft
    list must be a plausible continuation of exactly `token_ids` (prompt + output so far).
    """

    def propose(self, seq_id: str, token_ids: list[int], max_tokens: int, scope: str | None = None) -> list[int]: ...

    def finish(self, seq_id: str, token_ids: list[int], scope: str | None = None) -> None:
        """The sequence ended: drop its state (a proposer may keep its output to guess for others, but
        only for sequences of the same `scope`: the requests' cache salt, one per tenant)."""


def make_proposer(method: str, **options) -> Proposer | None:
    """The proposer for `--speculative-method`; None for "off"."""
    from engine.spec.ngram import NgramProposer
    from engine.spec.suffix import SuffixProposer

    if method == "off":
        return None
    if method == "ngram":
        return NgramProposer(**options)
    if method == "suffix":
        return SuffixProposer(**options)
    raise ValueError(f"speculative method {method!r}: choose one of {', '.join(SPECULATIVE_METHODS)}")
