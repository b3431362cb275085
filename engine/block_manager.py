"""The KV block pool: free list and reference counts. It knows nothing about requests."""

from __future__ import annotations

import itertools
from collections import deque


class OutOfBlocksError(RuntimeError):
    """Asked for more blocks than are free. The scheduler preempts before this can happen."""


class BlockManager:
    """Owns block ids 0..num_blocks-1.

    NOTE: invariant: every block is either in the free queue with ref count 0, or out of it with a
    ref count > 0. `check_integrity` asserts it; tests run it after every scenario.
    """

    MAX_RUN_SEARCH = 16384  # free blocks beyond which allocate_contiguous only looks at the queue's front

    def __init__(self, num_blocks: int, block_size: int):
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` blocks off the front of the free queue (ref count 1 each)."""
        if num_blocks > len(self._free):
            raise OutOfBlocksError(f"need {num_blocks} KV blocks, {len(self._free)} free")
        block_ids = [self._free.popleft() for _ in range(num_blocks)]
        for b in block_ids:
            self._ref_counts[b] = 1
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
                    taken = set(chosen)
                    self._free = deque(b for b in self._free if b not in taken)
                    for b in chosen:
                        self._ref_counts[b] = 1
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
                self._free.append(b)

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
