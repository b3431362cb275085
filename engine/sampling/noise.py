"""Counter-based random numbers for sampling: the noise of a draw is a pure function of the request's
seed, the position of the token in its sequence, a stream (what the noise is for) and the token id, so
a seeded request draws the same token whatever else shares its batch, in whichever row, on any device.

The hash is murmur3's 32-bit finalizer (`fmix32`), chained over the words of the key and then applied
per token to the row key xor a per-token word. Every value lives in the low 32 bits of an int64 and is
masked explicitly; multipliers are taken as signed residues so that no product reaches 2**63: no op
ever overflows int64, and the CPU and CUDA compute the same bits.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
# Streams: independent noise for the two uses at one position.
STREAM_DRAW = 1  # exponentials of the Gumbel / exponential-race draw (and of a rejected draft's residual)
STREAM_ACCEPT = 2  # the uniform that accepts or rejects a draft

_GOLDEN = 0x9E3779B1
_M1, _M2 = 0x85EBCA6B, 0xC2B2AE35
_token_words: dict[tuple[int, str], torch.Tensor] = {}


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32) (int64) and a 32-bit constant c, with no int64 overflow:
    a c of 2**31 or more is used as c - 2**32 (the same residue mod 2**32), so |x * c| < 2**63, and
    the mask takes the low 32 bits of the two's complement product."""
    return (x * (c - (1 << 32) if c >= 1 << 31 else c)) & MASK32


def fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's finalizer: a bijection of [0, 2**32) with full avalanche."""
    h = h ^ (h >> 16)
    h = _mul32(h, _M1)
    h ^= h >> 13
    h = _mul32(h, _M2)
    h ^= h >> 16
    return h


def _combine(h: torch.Tensor, word: torch.Tensor | int) -> torch.Tensor:
    return fmix32((_mul32(h ^ word, _GOLDEN) + 0x7F4A7C15) & MASK32)


def seed_words(seed: int) -> tuple[int, int]:
    """A seed in SamplingParams' range [-2**63, 2**64) as two 32-bit words (low, high)."""
    s = seed & ((1 << 64) - 1)
    return s & MASK32, s >> 32


def row_keys(seed_lo: torch.Tensor, seed_hi: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """One 32-bit key per row (int64 tensors [rows], values in [0, 2**32))."""
    h = fmix32(torch.full_like(positions, stream * 0x27D4EB2F & MASK32))
    for word in (seed_lo, seed_hi, positions & MASK32):
        h = _combine(h, word)
    return h


def _token_word(vocab: int, device: torch.device) -> torch.Tensor:
    """fmix32 of each token id, cached per vocabulary width and device: the per-token half of the hash."""
    key = (vocab, str(device))
    words = _token_words.get(key)
    if words is None:
        words = fmix32(_mul32(torch.arange(vocab, dtype=torch.long, device=device), _GOLDEN) ^ 0x3C6EF372)
        _token_words[key] = words
    return words


def to_unit(h: torch.Tensor) -> torch.Tensor:
    """The top 23 bits k of a 32-bit hash as the fp32 uniform (2k + 1) / 2**24: exactly representable,
    so never 0 or 1 (24 bits + 0.5 would need 25: the top value would round to 1.0, and -log(1) = 0
    would make the race divide by zero)."""
    return ((h >> 9) * 2 + 1).to(torch.float32) * (1.0 / (1 << 24))


def uniforms(keys: torch.Tensor) -> torch.Tensor:
    """One uniform in (0, 1) per row key [rows] (fp32)."""
    return to_unit(fmix32(keys ^ 0x1B873593))


def token_hashes(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """32-bit hashes [rows, vocab] (int64): row r, token t from (keys[r], t) alone. Two keyed rounds:
    one alone would make two rows' hashes F(x ^ k1), F(x ^ k2) of the same x."""
    k1 = keys.unsqueeze(1)
    k2 = fmix32(keys ^ 0x68E31DA4).unsqueeze(1)
    h = fmix32(_token_word(vocab, keys.device).unsqueeze(0) ^ k1)
    return fmix32(h ^ k2)


def exponentials(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Standard exponentials [rows, vocab] (fp32, > 0) from `token_hashes`."""
    return -torch.log(to_unit(token_hashes(keys, vocab)))
