"""Gather a request's KV blocks into one contiguous buffer and scatter it into other block ids.

The packed buffer is [layers, 2, n_blocks, block_size, kv_heads, head_dim]: the cache's layout with
dim 2 narrowed to the request's blocks, so any layer range of it (`buf[l0:l1]`) is contiguous too.
That is what lets the protocol send it in layer groups while the next group is still being packed.
"""

from __future__ import annotations

import torch

from kv_transfer.handle import KVLayout


def _index(block_ids, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(list(block_ids), dtype=torch.long, device=device)


def packed_buffer(layout: KVLayout, num_blocks: int, device: str | torch.device = "cpu") -> torch.Tensor:
    return torch.empty(layout.packed_shape(num_blocks), dtype=layout.torch_dtype, device=device)


def pack_blocks(kv_cache: torch.Tensor, block_ids, out: torch.Tensor | None = None,
                layers: slice = slice(None)) -> torch.Tensor:
    """Copy `kv_cache[layers, :, block_ids]` into `out[layers]` (allocated if None) and return `out`.

    NOTE: pass a reused `out`: a fresh 64 MiB buffer costs more in page faults than the copy itself.
    """
    idx = _index(block_ids, kv_cache.device)
    if out is None:
        out = torch.empty(kv_cache.shape[:2] + (len(idx),) + kv_cache.shape[3:], dtype=kv_cache.dtype,
                          device=kv_cache.device)
    assert out.shape[2] == len(idx) and out.shape[3:] == kv_cache.shape[3:], (out.shape, kv_cache.shape)
    torch.index_select(kv_cache[layers], 2, idx, out=out[layers])
    return out


def unpack_blocks(kv_cache: torch.Tensor, block_ids, packed: torch.Tensor, layers: slice = slice(None)) -> None:
    """Scatter `packed[layers]` into `kv_cache[layers, :, block_ids]` (the receiver's own block ids)."""
    idx = _index(block_ids, kv_cache.device)
    assert packed.shape[2] == len(idx) and packed.shape[3:] == kv_cache.shape[3:], (packed.shape, kv_cache.shape)
    kv_cache[layers].index_copy_(2, idx, packed[layers])


def layer_groups(layout: KVLayout, num_blocks: int, target_bytes: int = 8 << 20) -> list[slice]:
    """Split the layers into contiguous groups of about `target_bytes` each (at least one layer).

    Both sides derive the same groups from the handle alone, so the group sizes never go on the wire.
    """
    per_layer = max(1, num_blocks * layout.block_bytes // layout.num_layers)
    step = max(1, min(layout.num_layers, target_bytes // per_layer))
    return [slice(l0, min(l0 + step, layout.num_layers)) for l0 in range(0, layout.num_layers, step)]
