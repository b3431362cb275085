"""Suffix decoding (after SuffixDecoding, Snowflake 2024): frequency tries over token sequences, one per
running sequence (its prompt and output) and one over recent outputs of finished sequences. The
longest suffix of the sequence found in a trie is followed greedily along its most frequent
continuations while their estimated probability stays high, so the number of drafts varies with
confidence instead of being fixed."""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass


MAX_SCOPES = 64  # global tries kept (one per cache salt), least recently used dropped first
_KEY_SHIFT = 32  # an edge's key: parent node << 32 | token (token ids stay far below 2**32)


class SuffixTrie:
    """Every substring of the inserted tokens up to `depth` long, with how often each occurred.

    Nodes are integers (0: the root) and the trie is four flat containers: the edges (one dict from
    parent and token to child) and, per node, its count, its children's total count and its most
    frequent child's token (a tie keeps the earlier leader), kept as counts grow so following a path
    costs O(1) per token even where a node has thousands of children.

    NOTE: no Python object per node. A trie of node objects (each with a dict of children) made the
    cyclic garbage collector walk every node again and again as it grew: 30 us per indexed token at
    depth 13, 17x the cost of the same inserts into existing nodes. A dict of int -> int is not even
    tracked by the collector."""

    def __init__(self, depth: int):
        self.depth = depth
        self._edges: dict[int, int] = {}
        self._count = [0]
        self._total = [0]
        self._best = [-1]
        self._open: list[int] = []  # nodes of the suffixes ending at the last appended token

    @property
    def num_nodes(self) -> int:
        return len(self._count) - 1

    def append(self, token: int) -> None:
        """Extend every open suffix (and a new one from the root) by `token`: O(depth)."""
        edges, count, total, best = self._edges, self._count, self._total, self._best
        nxt = []
        opened = self._open
        for node in (0, *(opened if len(opened) < self.depth else opened[: self.depth - 1])):
            key = node << _KEY_SHIFT | token
            child = edges.get(key)
            if child is None:
                child = edges[key] = len(count)
                count.append(0)
                total.append(0)
                best.append(-1)
            count[child] += 1
            total[node] += 1
            b = best[node]
            if b < 0 or count[child] > count[edges[node << _KEY_SHIFT | b]]:
                best[node] = token
            nxt.append(child)
        self._open = nxt  # shortest suffix first

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            self.append(t)
        self._open = []  # the next extend is a separate sequence

    def match(self, context: list[int], max_len: int) -> tuple[int | None, int]:
        """The node of the longest suffix of `context` (at most `max_len`) present with something after
        it, and its length."""
        edges, total = self._edges, self._total
        for n in range(min(max_len, len(context)), 0, -1):
            node: int | None = 0
            for t in context[-n:]:
                node = edges.get(node << _KEY_SHIFT | t)
                if node is None:
                    break
            if node is not None and total[node]:
                return node, n
        return None, 0

    def follow(self, node: int, max_tokens: int, min_prob: float) -> tuple[list[int], float]:
        """Greedy walk along the most frequent continuations while their probability >= min_prob.
        Returns the tokens and their expected number accepted (sum of the running probabilities)."""
        out: list[int] = []
        prob, expected = 1.0, 0.0
        while len(out) < max_tokens and self._total[node]:
            token = self._best[node]
            child = self._edges[node << _KEY_SHIFT | token]
            prob *= self._count[child] / self._total[node]
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
    (rebuilt from them when it would exceed `max_global_nodes`). `max_drafts`: the most drafts ever
    asked for (the engine's num_speculative_tokens), if known.

    NOTE: a trie holds every substring up to `depth` tokens, so indexing a sequence costs O(depth) per
    token in Python (~5 us at depth 13, ~8 us at depth 25 on the 2-core CI machine); the depth is
    only as deep as a match plus the drafts that can follow it."""

    def __init__(self, max_match: int = 8, match_factor: float = 2.0, min_prob: float = 0.1,
                 max_global_seqs: int = 256, max_global_nodes: int = 2_000_000, max_drafts: int | None = None):
        self.max_match, self.match_factor, self.min_prob = max_match, match_factor, min_prob
        follow = int(max_match * match_factor)
        self.depth = max_match + (follow if max_drafts is None else min(follow, max_drafts)) + 1
        self._local: dict[str, tuple[SuffixTrie, int]] = {}  # seq -> (its trie, tokens appended)
        self.max_global_seqs = max_global_seqs
        self.max_global_nodes = max_global_nodes
        # One global trie per scope (the requests' cache salt): finished outputs teach only requests of
        # the same scope, so one tenant's drafts never reveal another's text. The least recently used
        # scope is dropped past MAX_SCOPES.
        self._scopes: OrderedDict[str | None, _GlobalTrie] = OrderedDict()

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
        return trie.follow(node, min(max_tokens, max(1, int(n * self.match_factor))), self.min_prob)

    def _scope(self, scope: str | None, create: bool) -> _GlobalTrie | None:
        g = self._scopes.get(scope)
        if g is None and create:
            g = self._scopes[scope] = _GlobalTrie(SuffixTrie(self.depth), deque(maxlen=self.max_global_seqs))
            while len(self._scopes) > MAX_SCOPES:
                self._scopes.popitem(last=False)
        if g is not None:
            self._scopes.move_to_end(scope)
        return g

    @property
    def _global(self) -> SuffixTrie:
        """The unscoped global trie (tests)."""
        g = self._scope(None, create=False)
        return g.trie if g is not None else SuffixTrie(self.depth)

    def propose(self, seq_id: str, token_ids: list[int], max_tokens: int, scope: str | None = None) -> list[int]:
        if max_tokens <= 0 or not token_ids:
            return []
        local = self._local_trie(seq_id, token_ids)
        # The local trie holds the sequence's own last suffix too; matching on the context without its
        # last token would miss the newest evidence, so match the whole context: the open suffix has
        # no children of its own yet unless it occurred before.
        best, best_score = self._candidate(local, token_ids, max_tokens)
        g = self._scope(scope, create=False)
        if g is None:
            return best
        glob, glob_score = self._candidate(g.trie, token_ids, max_tokens)
        return glob if glob_score > best_score else best

    def finish(self, seq_id: str, token_ids: list[int], scope: str | None = None) -> None:
        self._local.pop(seq_id, None)
        if not token_ids:
            return
        g = self._scope(scope, create=True)
        g.recent.append(list(token_ids))
        if g.trie.num_nodes + len(token_ids) * self.depth > self.max_global_nodes:
            g.trie = SuffixTrie(self.depth)
            for seq in g.recent:
                g.trie.extend(seq)
        else:
            g.trie.extend(token_ids)


@dataclass(slots=True)
class _GlobalTrie:
    trie: SuffixTrie
    recent: deque[list[int]]
