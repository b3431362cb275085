"""Pack/unpack on tiny tensors: exact block contents, different ids and pool sizes on each side."""

import pickle

import torch

from kv_transfer import KVHandle, KVLayout, pack_blocks, unpack_blocks
from kv_transfer.packing import layer_groups
from kv_transfer.protocol import HEADER_LEN, Status, decode_header, encode_header, request_hash

import pytest


def _cache(num_blocks, layers=3, block_size=4, heads=2, dim=5):
    n = layers * 2 * num_blocks * block_size * heads * dim
    return torch.arange(n, dtype=torch.float32).view(layers, 2, num_blocks, block_size, heads, dim)


def test_pack_gathers_blocks_in_order():
    src = _cache(10)
    packed = pack_blocks(src, [7, 2, 5])
    assert packed.shape == (3, 2, 3, 4, 2, 5) and packed.is_contiguous()
    for i, b in enumerate([7, 2, 5]):
        assert torch.equal(packed[:, :, i], src[:, :, b])


def test_unpack_into_other_ids_and_pool_size():
    src, dst = _cache(10), torch.zeros(3, 2, 6, 4, 2, 5)
    packed = pack_blocks(src, [7, 2, 5])
    unpack_blocks(dst, [0, 4, 1], packed)
    for s, d in zip([7, 2, 5], [0, 4, 1]):
        assert torch.equal(dst[:, :, d], src[:, :, s])
    for untouched in (2, 3, 5):
        assert not dst[:, :, untouched].any()


def test_pack_by_layer_groups_into_reused_buffer():
    src = _cache(8)
    out = torch.full((3, 2, 2, 4, 2, 5), -1.0)
    for g in (slice(0, 2), slice(2, 3)):
        pack_blocks(src, [6, 1], out=out, layers=g)
    assert torch.equal(out, pack_blocks(src, [6, 1]))


def test_layer_groups_cover_all_layers():
    layout = KVLayout(30, 3, 64, "float32", 16)
    for n in (1, 32, 91):
        groups = layer_groups(layout, n, 8 << 20)
        assert groups[0].start == 0 and groups[-1].stop == 30
        assert all(a.stop == b.start for a, b in zip(groups, groups[1:]))
    assert len(layer_groups(layout, 1, 8 << 20)) == 1


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
    from kv_transfer import ProtocolError
    with pytest.raises(ProtocolError):
        decode_header(t)
