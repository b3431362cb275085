"""Gather a request's KV blocks into one contiguous buffer and scatter it into other block ids.

The cache is block-major, [num_blocks, layers, 2, block_size, kv_heads, head_dim]: one block is one
contiguous row of `KVLayout.block_bytes`. A packed buffer is the cache's layout narrowed to the
request's blocks, [n_blocks, ...], so any block range of it (`buf[b0:b1]`) is contiguous too. That is
what lets the protocol send it in chunks while the next chunk is still being packed.
"""

from __future__ import annotations

import torch

from kv_transfer.handle import KVLayout


def _index(block_ids, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(list(block_ids), dtype=torch.long, device=device)


def _rows(t: torch.Tensor) -> torch.Tensor:
    rows = t.view(t.shape[0], -1)
    # fp8 caches: torch has no fp8 index_copy_; the blocks are moved as bytes either way.
    return rows.view(torch.uint8) if rows.element_size() == 1 else rows


def packed_buffer(layout: KVLayout, num_blocks: int, device: str | torch.device = "cpu") -> torch.Tensor:
    return torch.empty(layout.packed_shape(num_blocks), dtype=layout.torch_dtype, device=device)


def pack_blocks(kv_cache: torch.Tensor, block_ids, out: torch.Tensor | None = None,
                blocks: slice = slice(None)) -> torch.Tensor:
    """Copy `kv_cache[block_ids[blocks]]` into `out[blocks]` (allocated if None) and return `out`.

    NOTE: pass a reused `out`: a fresh 64 MiB buffer costs more in page faults than the copy itself.
    """
    ids = list(block_ids)
    if out is None:
        out = torch.empty((len(ids),) + kv_cache.shape[1:], dtype=kv_cache.dtype, device=kv_cache.device)
    assert out.shape[0] == len(ids) and out.shape[1:] == kv_cache.shape[1:], (out.shape, kv_cache.shape)
    torch.index_select(_rows(kv_cache), 0, _index(ids[blocks], kv_cache.device), out=_rows(out[blocks]))
    return out


def unpack_blocks(kv_cache: torch.Tensor, block_ids, packed: torch.Tensor, blocks: slice = slice(None)) -> None:
    """Scatter `packed[blocks]` into `kv_cache[block_ids[blocks]]` (the receiver's own block ids)."""
    ids = list(block_ids)
    assert packed.shape[0] == len(ids) and packed.shape[1:] == kv_cache.shape[1:], (packed.shape, kv_cache.shape)
    _rows(kv_cache).index_copy_(0, _index(ids[blocks], kv_cache.device), _rows(packed[blocks]))


def block_chunks(layout: KVLayout, num_blocks: int, target_bytes: int = 8 << 20) -> list[slice]:
    """Split blocks 0..num_blocks-1 into consecutive chunks of about `target_bytes` (at least one
    block each): the wire messages of one transfer.

    Both sides derive the same chunks from the handle alone, so their sizes never go on the wire.
    """
    step = max(1, target_bytes // layout.block_bytes)
    return [slice(b0, min(b0 + step, num_blocks)) for b0 in range(0, num_blocks, step)]
