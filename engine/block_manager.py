"""The KV block pool: free list, reference counts and the prefix cache. It knows nothing about requests."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Hashable

# A full block's identity for the prefix cache: SHA-256 of the previous block's key and this block's
# tokens (`engine.request.extend_block_keys`). Two blocks with equal keys hold the same KV (same model,
# same tokens at the same positions, same cache salt).
# NOTE: a cryptographic hash, not Python's hash(): with a 64-bit non-cryptographic hash a client could
# craft a prompt whose blocks collide with another tenant's and read their KV (vLLM's CVE-2025-25183).
BlockKey = bytes


class OutOfBlocksError(RuntimeError):
    """Asked for more blocks than are free. The scheduler preempts before this can happen."""


class BlockManager:
    """Owns block ids 0..num_blocks-1.

    NOTE: invariant: every block is either in the free queue with ref count 0, or out of it with a
    ref count > 0. `check_integrity` asserts it; tests run it after every scenario.

    Prefix cache: a full block whose KV was computed may be registered under its `BlockKey`. It keeps
    that key after it is freed, in the free queue, until `allocate` hands it out again (the front of
    the queue: least recently freed first), so a later request with the same prefix takes it back
    (`lookup` + `take`) instead of recomputing it. Cached blocks count as free.
    """

    MAX_RUN_SEARCH = 16384  # free blocks beyond which allocate_contiguous only looks at the queue's front

    def __init__(self, num_blocks: int, block_size: int):
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        # An ordered set: O(1) removal of a cached block taken back from the middle of the queue.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._keys: list[Hashable | None] = [None] * num_blocks  # block -> its prefix-cache key
        self._cached: dict[Hashable, int] = {}  # key -> block

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` blocks off the front of the free queue (ref count 1 each)."""
        if num_blocks > len(self._free):
            raise OutOfBlocksError(f"need {num_blocks} KV blocks, {len(self._free)} free")
        block_ids = [self._free.popitem(last=False)[0] for _ in range(num_blocks)]
        for b in block_ids:
            self._ref_counts[b] = 1
            self._evict(b)
        return block_ids

    def allocate_contiguous(self, num_blocks: int) -> list[int] | None:
        """`num_blocks` consecutive ids (ref count 1 each): the front of the free queue if it is such a
        run, else the lowest run, or None if there is none (or the free list is too long to search).
        Imported KV lands in a run straight off the wire, with no staging copy (kv_transfer.protocol)."""
        if num_blocks > len(self._free):
            return None
        front = list(itertools.islice(self._free, num_blocks))
        if all(b == front[0] + i for i, b in enumerate(front)):  # the usual case in a fresh pool: O(n)
            return self.allocate(num_blocks)
        if len(self._free) > self.MAX_RUN_SEARCH:  # not worth a sort of a huge free list per import
            return None
        free = sorted(self._free)
        start = 0
        for i in range(1, len(free) + 1):
            if i == len(free) or free[i] != free[i - 1] + 1:
                if i - start >= num_blocks:
                    chosen = free[start:start + num_blocks]
                    for b in chosen:
                        del self._free[b]
                        self._ref_counts[b] = 1
                        self._evict(b)
                    return chosen
                start = i
        return None

    def incref(self, block_ids: list[int]) -> None:
        for b in block_ids:
            assert self._ref_counts[b] > 0, f"incref of free block {b}"
            self._ref_counts[b] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; blocks reaching zero go to the back of the free queue."""
        for b in block_ids:
            assert self._ref_counts[b] > 0, f"double free of block {b}"
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free[b] = None

    # ------------------------------------------------------------------ prefix cache
    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def _evict(self, block_id: int) -> None:
        key = self._keys[block_id]
        if key is not None:
            self._keys[block_id] = None
            del self._cached[key]

    def register(self, block_id: int, key: Hashable) -> None:
        """Record that `block_id` (in use, full, computed) holds the KV of `key`. A key already cached
        keeps its block; this one then stays private to its request."""
        assert self._ref_counts[block_id] > 0, f"register of free block {block_id}"
        if key not in self._cached and self._keys[block_id] is None:
            self._cached[key] = block_id
            self._keys[block_id] = key

    def lookup(self, keys: list[Hashable]) -> list[int]:
        """The cached blocks of the longest prefix of `keys` (no references taken)."""
        out = []
        for key in keys:
            b = self._cached.get(key)
            if b is None:
                break
            out.append(b)
        return out

    def num_free_after_taking(self, block_ids: list[int]) -> int:
        """Free blocks left once `take(block_ids)` has revived the free ones among them."""
        return len(self._free) - sum(1 for b in block_ids if self._ref_counts[b] == 0)

    def take(self, block_ids: list[int]) -> None:
        """Add a reference to each of `block_ids` (cached blocks from `lookup`), reviving free ones."""
        for b in block_ids:
            if self._ref_counts[b] == 0:
                del self._free[b]
            self._ref_counts[b] += 1

    def reset_prefix_cache(self) -> None:
        """Forget every cached key (the blocks stay where they are)."""
        for b in self._cached.values():
            self._keys[b] = None
        self._cached.clear()

    def check_integrity(self) -> None:
        """Raise AssertionError if free + used != total or a ref count disagrees with the free queue."""
        free_set = set(self._free)
        assert len(free_set) == len(self._free), "a block is in the free queue twice"
        used = [b for b in range(self.num_blocks) if self._ref_counts[b] > 0]
        assert len(free_set) + len(used) == self.num_blocks, (
            f"leak: {len(free_set)} free + {len(used)} used != {self.num_blocks} total"
        )
        for b in free_set:
            assert self._ref_counts[b] == 0, f"free block {b} has ref count {self._ref_counts[b]}"
        assert len(self._cached) == sum(k is not None for k in self._keys), "prefix cache and block keys disagree"
        for key, b in self._cached.items():
            assert self._keys[b] == key, f"cached block {b} lost its key"
