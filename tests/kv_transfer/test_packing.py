"""Pack/unpack on tiny tensors: exact block contents, different ids and pool sizes on each side."""

import pickle

import pytest
import torch

from kv_transfer import KVHandle, KVLayout, ProtocolError, pack_blocks, unpack_blocks
from kv_transfer.packing import block_chunks
from kv_transfer.protocol import HEADER_LEN, Status, decode_header, encode_header, request_hash


def _cache(num_blocks, layers=3, block_size=4, heads=2, dim=5):
    """Block-major, like the engine's: [blocks, layers, K/V, block size, kv heads, head dim]."""
    n = num_blocks * layers * 2 * block_size * heads * dim
    return torch.arange(n, dtype=torch.float32).view(num_blocks, layers, 2, block_size, heads, dim)


def test_pack_gathers_blocks_in_order():
    src = _cache(10)
    packed = pack_blocks(src, [7, 2, 5])
    assert packed.shape == (3, 3, 2, 4, 2, 5) and packed.is_contiguous()
    for i, b in enumerate([7, 2, 5]):
        assert torch.equal(packed[i], src[b])


def test_unpack_into_other_ids_and_pool_size():
    src, dst = _cache(10), torch.zeros(6, 3, 2, 4, 2, 5)
    packed = pack_blocks(src, [7, 2, 5])
    unpack_blocks(dst, [0, 4, 1], packed)
    for s, d in zip([7, 2, 5], [0, 4, 1]):
        assert torch.equal(dst[d], src[s])
    for untouched in (2, 3, 5):
        assert not dst[untouched].any()


def test_pack_and_unpack_by_chunks_into_reused_buffer():
    src, dst = _cache(8), torch.zeros(5, 3, 2, 4, 2, 5)
    out = torch.full((3, 3, 2, 4, 2, 5), -1.0)
    for c in (slice(0, 2), slice(2, 3)):
        pack_blocks(src, [6, 1, 3], out=out, blocks=c)
    assert torch.equal(out, pack_blocks(src, [6, 1, 3]))
    for c in (slice(0, 1), slice(1, 3)):
        unpack_blocks(dst, [4, 0, 2], out, blocks=c)
    assert torch.equal(dst[[4, 0, 2]], src[[6, 1, 3]])


def test_block_chunks_cover_all_blocks():
    layout = KVLayout(30, 3, 64, "float32", 16)  # SmolLM2: 720 KiB blocks
    for n in (1, 11, 32, 91):
        chunks = block_chunks(layout, n, 8 << 20)
        assert chunks[0].start == 0 and chunks[-1].stop == n
        assert all(a.stop == b.start for a, b in zip(chunks, chunks[1:]))
        assert all(0 < (c.stop - c.start) * layout.block_bytes <= 8 << 20 for c in chunks)
    assert len(block_chunks(layout, 32, 8 << 20)) == 3  # 22.5 MiB: 3 messages, not 60 planes
    assert block_chunks(layout, 3, 1) == [slice(0, 1), slice(1, 2), slice(2, 3)]  # at least a block each


def test_handle_pickles_and_knows_its_size():
    layout = KVLayout.of(_cache(4))
    assert layout == KVLayout(3, 2, 5, "float32", 4)
    h = KVHandle("w0", "r1", (3, 1), 6, layout, 42, 7, 123.0)
    assert pickle.loads(pickle.dumps(h)) == h
    assert h.nbytes == 2 * 3 * 2 * 4 * 2 * 5 * 4
    assert h.expired(now=123.0) and not h.expired(now=122.9)


def test_header_roundtrip_and_corruption():
    h = KVHandle("w0", "req-1", (3, 1), 6, KVLayout(3, 2, 5, "float32", 4), 42, 7, 123.0)
    t = encode_header(Status.OK, h, 2)
    assert t.shape == (HEADER_LEN,)
    hdr = decode_header(t)
    assert (hdr.status, hdr.request_hash, hdr.epoch, hdr.num_blocks, hdr.num_tokens, hdr.num_messages) == (
        Status.OK, request_hash("req-1"), 7, 2, 6, 2)
    t[4] += 1
    with pytest.raises(ProtocolError):
        decode_header(t)
