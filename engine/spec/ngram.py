"""Prompt lookup (vLLM's `ngram` method): find the sequence's last n tokens earlier in the sequence and
propose the tokens that followed that earlier occurrence. Pays off when the output copies its input:
summaries, extraction, edits of a given text or code."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class _SeqIndex:
    # (n-gram) -> the position just after its latest occurrence that ends before the sequence's end.
    last_end: dict[tuple[int, ...], int] = field(default_factory=dict)
    num_indexed: int = 0  # n-grams ending before this position are in last_end


class NgramProposer:
    """Incremental per sequence: each new token adds one entry per n-gram size, so a proposal costs
    O(max_n) however long the sequence is."""

    def __init__(self, min_n: int = 2, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n ({min_n}) <= max_n ({max_n})")
        self.min_n, self.max_n = min_n, max_n
        self._seqs: dict[str, _SeqIndex] = {}

    def _index(self, seq_id: str, token_ids: list[int]) -> _SeqIndex:
        idx = self._seqs.get(seq_id)
        if idx is None or idx.num_indexed > len(token_ids):  # new, or rolled back: rebuild
            idx = self._seqs[seq_id] = _SeqIndex()
        # Index every n-gram that ends before the last token: an occurrence that ends at the very end
        # is the suffix itself, with nothing after it to propose.
        for end in range(max(idx.num_indexed, 1), len(token_ids)):
            for n in range(self.min_n, self.max_n + 1):
                if end >= n:
                    idx.last_end[tuple(token_ids[end - n:end])] = end
        idx.num_indexed = max(idx.num_indexed, len(token_ids))
        return idx

    def propose(self, seq_id: str, token_ids: list[int], max_tokens: int, scope: str | None = None) -> list[int]:
        if max_tokens <= 0 or len(token_ids) < self.min_n + 1:
            return []
        idx = self._index(seq_id, token_ids)
        for n in range(min(self.max_n, len(token_ids) - 1), self.min_n - 1, -1):
            end = idx.last_end.get(tuple(token_ids[-n:]))
            if end is not None:
                return list(token_ids[end:end + max_tokens])
        return []

    def finish(self, seq_id: str, token_ids: list[int], scope: str | None = None) -> None:
        self._seqs.pop(seq_id, None)
