"""Suffix decoding (after SuffixDecoding, Snowflake 2024): frequency tries over token sequences, one per
running sequence (its prompt and output) and one over recent outputs of finished sequences. The
longest suffix of the sequence found in a trie is followed greedily along its most frequent
continuations while their estimated probability stays high, so the number of drafts varies with
confidence instead of being fixed."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(slots=True)
class _Node:
    count: int = 0
    children: dict[int, _Node] = field(default_factory=dict)


class SuffixTrie:
    """Every substring of the inserted tokens up to `depth` long, with how often each occurred."""

    def __init__(self, depth: int):
        self.depth = depth
        self.root = _Node()
        self.num_nodes = 0
        self._open: list[_Node] = []  # nodes of the suffixes ending at the last appended token

    def append(self, token: int) -> None:
        """Extend every open suffix (and a new one from the root) by `token`: O(depth)."""
        nxt = []
        for node in [self.root] + self._open[: self.depth - 1]:
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = _Node()
                self.num_nodes += 1
            child.count += 1
            nxt.append(child)
        self._open = nxt  # shortest suffix first

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            self.append(t)
        self._open = []  # the next extend is a separate sequence

    def match(self, context: list[int], max_len: int) -> tuple[_Node | None, int]:
        """The node of the longest suffix of `context` (at most `max_len`) present, and its length."""
        for n in range(min(max_len, len(context)), 0, -1):
            node = self.root
            for t in context[-n:]:
                node = node.children.get(t)
                if node is None:
                    break
            if node is not None and node.children:
                return node, n
        return None, 0


def _follow(node: _Node, max_tokens: int, min_prob: float) -> tuple[list[int], float]:
    """Greedy walk along the most frequent continuations while their probability >= min_prob.
    Returns the tokens and their expected number accepted (sum of the running probabilities)."""
    out: list[int] = []
    prob, expected = 1.0, 0.0
    while len(out) < max_tokens and node.children:
        total = sum(c.count for c in node.children.values())
        token, child = max(node.children.items(), key=lambda kv: kv[1].count)
        prob *= child.count / total
        if prob < min_prob:
            break
        out.append(token)
        expected += prob
        node = child
    return out, expected


class SuffixProposer:
    """`max_match`: longest suffix looked up; drafts are capped at `match_factor` x the match length
    (a long match predicts further); `min_prob`: stop drafting when the path's estimated probability
    falls below it. The global trie holds the outputs of the last `max_global_seqs` finished sequences
    (rebuilt from them when it would exceed `max_global_nodes`)."""

    def __init__(self, max_match: int = 8, match_factor: float = 2.0, min_prob: float = 0.1,
                 max_global_seqs: int = 256, max_global_nodes: int = 2_000_000):
        self.max_match, self.match_factor, self.min_prob = max_match, match_factor, min_prob
        self.depth = max_match + int(max_match * match_factor) + 1
        self._local: dict[str, tuple[SuffixTrie, int]] = {}  # seq -> (its trie, tokens appended)
        self._recent: deque[list[int]] = deque(maxlen=max_global_seqs)
        self.max_global_nodes = max_global_nodes
        self._global = SuffixTrie(self.depth)

    def _local_trie(self, seq_id: str, token_ids: list[int]) -> SuffixTrie:
        trie, n = self._local.get(seq_id, (None, 0))
        if trie is None or n > len(token_ids):
            trie, n = SuffixTrie(self.depth), 0
        for t in token_ids[n:]:
            trie.append(t)
        self._local[seq_id] = (trie, len(token_ids))
        return trie

    def _candidate(self, trie: SuffixTrie, token_ids: list[int], max_tokens: int) -> tuple[list[int], float]:
        node, n = trie.match(token_ids, self.max_match)
        if node is None:
            return [], 0.0
        return _follow(node, min(max_tokens, max(1, int(n * self.match_factor))), self.min_prob)

    def propose(self, seq_id: str, token_ids: list[int], max_tokens: int) -> list[int]:
        if max_tokens <= 0 or not token_ids:
            return []
        local = self._local_trie(seq_id, token_ids)
        # The local trie holds the sequence's own last suffix too; matching on the context without its
        # last token would miss the newest evidence, so match the whole context: the open suffix has
        # no children of its own yet unless it occurred before.
        best, best_score = self._candidate(local, token_ids, max_tokens)
        glob, glob_score = self._candidate(self._global, token_ids, max_tokens)
        return glob if glob_score > best_score else best

    def finish(self, seq_id: str, token_ids: list[int]) -> None:
        self._local.pop(seq_id, None)
        if not token_ids:
            return
        self._recent.append(list(token_ids))
        if self._global.num_nodes + len(token_ids) * self.depth > self.max_global_nodes:
            self._global = SuffixTrie(self.depth)
            for seq in self._recent:
                self._global.extend(seq)
        else:
            self._global.extend(token_ids)
