"""The router's picture of the workers' prefix caches, for cache-aware placement.

Each engine keeps the KV of full prompt blocks after a request ends (automatic prefix caching) and
reuses it when a later prompt starts with the same tokens. The router cannot see those caches, but it
knows which prompts it sent where. `PrefixIndex` remembers, per worker, the chained hashes of the full
blocks of the prompts it computed there (least recently used dropped beyond the worker's KV capacity),
so the router can send a prompt where most of it is already cached. Like the engine's own cache it
never reuses the block holding the last prompt token: that one is always computed.

It is an estimate: a worker may have evicted blocks the index still lists (it reallocated them for
other requests), and a restarted router starts with an empty index. Both only cost a cache miss.
"""

from __future__ import annotations

from collections import OrderedDict

from engine.request import extend_block_keys


def block_hashes(token_ids: list[int], block_size: int, cache_salt: str | None = None) -> list[bytes]:
    """One key per full block, each covering every token before it too (a block only matches at the
    same position after the same prefix, under the same salt): the engine's own prefix-cache keys,
    SHA-256 chains (a crafted prompt cannot collide with another tenant's blocks)."""
    return extend_block_keys([], token_ids, len(token_ids) // block_size, block_size, cache_salt)


class PrefixIndex:
    def __init__(self, block_size: int):
        self.block_size = block_size
        self._blocks: dict[str, OrderedDict[int, None]] = {}
        self._capacity: dict[str, int] = {}

    def add_worker(self, worker_id: str, capacity_blocks: int) -> None:
        self._blocks.setdefault(worker_id, OrderedDict())
        self._capacity[worker_id] = max(1, capacity_blocks)

    def remove_worker(self, worker_id: str) -> None:
        self._blocks.pop(worker_id, None)
        self._capacity.pop(worker_id, None)

    def record(self, worker_id: str, hashes: list[bytes]) -> None:
        """`worker_id` computed (or is about to compute) a prompt with these full-block hashes."""
        blocks = self._blocks.get(worker_id)
        if blocks is None:
            return
        for h in hashes:
            blocks[h] = None
            blocks.move_to_end(h)
        cap = self._capacity[worker_id]
        while len(blocks) > cap:
            blocks.popitem(last=False)

    def cached_tokens(self, worker_id: str, hashes: list[bytes], num_tokens: int) -> int:
        """Prompt tokens of a `num_tokens`-token prompt that `worker_id` likely has cached: its leading
        blocks found there, never the last token."""
        blocks = self._blocks.get(worker_id)
        if not blocks:
            return 0
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return max(0, min(n * self.block_size, (num_tokens - 1) // self.block_size * self.block_size))

    def num_blocks(self, worker_id: str) -> int:
        return len(self._blocks.get(worker_id, ()))
