"""A tensor-parallel engine's KV blocks with every KV head: gathered from its ranks for an export,
scattered to them after an import (kv_transfer sends full-head blocks between workers).

Each rank's cache holds its own KV heads (`ShardLayout`: a contiguous run, or one replicated head
when there are more ranks than KV heads). Rank 0, holding the group's lock (`TPGroup.lock`, so no
step's collectives interleave), names the blocks to the followers through the group's message
stream, and one gloo/NCCL gather or scatter moves each rank's slice:

    export (gather_kv)                                  import (scatter_kv)
    rank 0: send KVGatherMessage(ids)                   rank 0: send KVScatterMessage(ids)
    every rank: pack its heads of blocks ids            rank 0: slice the full blocks by rank's heads
    gather -> rank 0 places each rank's heads           scatter -> each rank writes its slice at ids
    -> [n, layers, 2, block_size, KV heads, head_dim]

Block ids are the same on every rank: rank 0's block manager owns them all. Never imports Ray.
"""

from __future__ import annotations

import torch

from engine.models.sharding import ShardLayout, check_tp_shapes
from engine.parallel.messages import KVGatherMessage, KVScatterMessage

LOCK_TIMEOUT_S = 120.0  # longest a KV gather/scatter waits for the step under way to end


def full_kv_heads(hf_cfg) -> int:
    return check_tp_shapes(hf_cfg, 1)[1]


def _layouts(runner) -> list[ShardLayout]:
    return [ShardLayout.of(runner.config, runner.tp.world, r) for r in range(runner.tp.world)]


def _cache_bytes(runner) -> torch.Tensor:
    # NOTE: everything here moves bytes ([..., heads, head_dim * element size]): gloo has no fp8 (nor,
    # on some builds, bf16), and torch no fp8 index_copy_. Slicing heads is the same on this view.
    return runner.kv_cache.view(torch.uint8)


def _index(ids, device) -> torch.Tensor:
    return torch.as_tensor(ids, dtype=torch.long, device=device)


def full_shape(runner, num_blocks: int) -> tuple[int, ...]:
    """Every KV head of `num_blocks` blocks, in the cache's dtype."""
    _, layers, two, bs, _, hd = runner.kv_cache.shape
    return (num_blocks, layers, two, bs, full_kv_heads(runner.config), hd)


class _Locked:
    """Rank 0's hold on its group for one KV message and its collective (a bounded wait)."""

    def __init__(self, tp):
        self.tp = tp

    def __enter__(self):
        if not self.tp.lock.acquire(timeout=LOCK_TIMEOUT_S):
            raise TimeoutError(f"the tensor-parallel group stayed busy for {LOCK_TIMEOUT_S:.0f} s")
        return self

    def __exit__(self, *exc):
        self.tp.lock.release()


@torch.inference_mode()
def gather_kv(runner, block_ids) -> torch.Tensor:
    """Rank 0: the KV of `block_ids` with every KV head, [n, layers, 2, block_size, KV heads, head_dim]."""
    tp = runner.tp
    ids = tuple(int(b) for b in block_ids)
    cache = _cache_bytes(runner)
    with _Locked(tp):
        tp.send(KVGatherMessage(ids))
        mine = cache.index_select(0, _index(ids, cache.device))
        parts = tp.gather_list(mine)
    full = torch.empty(mine.shape[:-2] + (full_kv_heads(runner.config), mine.shape[-1]), dtype=torch.uint8,
                       device=mine.device)
    for lay, part in zip(_layouts(runner), parts):  # a replicated head is written once per rank holding it
        full[..., lay.kv_head0:lay.kv_head0 + lay.num_kv_heads, :] = part
    return full.view(runner.kv_cache.dtype)


@torch.inference_mode()
def scatter_kv(runner, block_ids, full: torch.Tensor) -> None:
    """Rank 0: write `full` (every KV head of `block_ids`, as `gather_kv` returns it) into every
    rank's cache, each rank its own heads."""
    tp = runner.tp
    ids = tuple(int(b) for b in block_ids)
    assert tuple(full.shape) == full_shape(runner, len(ids)), (tuple(full.shape), full_shape(runner, len(ids)))
    fb = full.contiguous().view(torch.uint8)
    parts = [fb[..., lay.kv_head0:lay.kv_head0 + lay.num_kv_heads, :].contiguous() for lay in _layouts(runner)]
    cache = _cache_bytes(runner)
    with _Locked(tp):
        tp.send(KVScatterMessage(ids))
        mine = tp.scatter_list(parts, torch.empty_like(parts[0]))
    cache.index_copy_(0, _index(ids, cache.device), mine)


@torch.inference_mode()
def follow_kv(runner, msg: KVGatherMessage | KVScatterMessage) -> None:
    """A follower's side of `gather_kv` / `scatter_kv`."""
    cache = _cache_bytes(runner)
    idx = _index(msg.block_ids, cache.device)
    if isinstance(msg, KVGatherMessage):
        runner.tp.gather_list(cache.index_select(0, idx))
        return
    out = torch.empty((len(msg.block_ids),) + tuple(cache.shape[1:]), dtype=torch.uint8, device=cache.device)
    cache.index_copy_(0, idx, runner.tp.scatter_list(None, out))
