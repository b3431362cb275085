"""`KVHandle`: what a prefill worker hands out so that a decode worker can fetch a request's KV blocks."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape of one KV block. Both sides must agree on it; only block ids and pool sizes may differ."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32"
    block_size: int

    @classmethod
    def of(cls, kv_cache: torch.Tensor) -> KVLayout:
        """The layout of an engine's cache tensor [num_blocks, layers, 2, block_size, kv_heads, head_dim]."""
        assert kv_cache.dim() == 6 and kv_cache.shape[2] == 2, f"not a KV cache: {tuple(kv_cache.shape)}"
        _, layers, _, block_size, kv_heads, head_dim = kv_cache.shape
        return cls(layers, kv_heads, head_dim, str(kv_cache.dtype).removeprefix("torch."), block_size)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers, keys and values."""
        elem = torch.empty((), dtype=self.torch_dtype).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * elem

    def packed_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


@dataclass(frozen=True, slots=True)
class KVHandle:
    """A lease on one prefilled request's KV blocks in one prefill worker.

    Crosses process boundaries (Ray pickles it). The decode side needs nothing else to fetch the KV;
    the prompt token ids travel with the request, not here.
    """

    worker_id: str          # the exporting (prefill) worker
    request_id: str
    block_ids: tuple[int, ...]  # sender-side ids, covering exactly `num_tokens` tokens
    num_tokens: int         # tokens whose KV is in the blocks (the prompt; the first token is not)
    layout: KVLayout
    first_token: int        # sampled by the prefill; the decode side continues after it
    epoch: int              # which grant of this request; a re-grant supersedes older handles
    expires_at: float       # wall clock (time.time()); the sender frees the blocks after it

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.layout.block_bytes

    def expired(self, now: float | None = None) -> bool:
        """On the SENDER's clock only: `expires_at` is its wall clock, and hosts' clocks differ."""
        return (time.time() if now is None else now) >= self.expires_at
