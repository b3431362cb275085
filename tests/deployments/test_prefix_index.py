"""The router's map of where prompt prefixes are cached (no Ray, no model)."""

from __future__ import annotations

from deployments.cluster.prefix_index import PrefixIndex, block_hashes

BS = 4


def test_block_hashes_cover_full_blocks_and_everything_before_them():
    a = list(range(10))
    assert len(block_hashes(a, BS)) == 2  # the 2 tokens of the third block are not a full block
    assert block_hashes(a, BS) == block_hashes(a[:8], BS)
    b = [99] + a[1:]  # first block differs: no later block may match either
    assert all(x != y for x, y in zip(block_hashes(a, BS), block_hashes(b, BS)))
    c = a[:4] + [99] + a[5:]  # second block differs: the first still matches
    ha, hc = block_hashes(a, BS), block_hashes(c, BS)
    assert ha[0] == hc[0] and ha[1] != hc[1]
    shifted = [7, 7, 7, 7] + a[:4]  # the same tokens at another position do not match
    assert block_hashes(shifted, BS)[1] != ha[0]


def test_cached_tokens_counts_leading_blocks_and_never_the_last_token():
    idx = PrefixIndex(BS)
    idx.add_worker("p0", 100)
    idx.add_worker("p1", 100)
    prompt = list(range(12))
    idx.record("p0", block_hashes(prompt, BS))
    h = block_hashes(prompt, BS)
    # 12 tokens, 3 full blocks: the block holding the last token is computed again, as in the engine.
    assert idx.cached_tokens("p0", h, 12) == 8
    assert idx.cached_tokens("p1", h, 12) == 0
    longer = prompt + [50, 51, 52, 53, 54]
    assert idx.cached_tokens("p0", block_hashes(longer, BS), len(longer)) == 12
    other_start = [1] + prompt[1:]
    assert idx.cached_tokens("p0", block_hashes(other_start, BS), 12) == 0
    idx.remove_worker("p0")
    assert idx.cached_tokens("p0", h, 12) == 0
    idx.record("p0", h)  # a removed (dead, drained) worker is not recorded again
    assert idx.num_blocks("p0") == 0


def test_least_recently_recorded_blocks_go_first_beyond_capacity():
    idx = PrefixIndex(BS)
    idx.add_worker("p0", 4)
    old, new = list(range(100, 112)), list(range(200, 212))
    idx.record("p0", block_hashes(old, BS))
    idx.record("p0", block_hashes(new, BS))
    assert idx.num_blocks("p0") == 4
    assert idx.cached_tokens("p0", block_hashes(new, BS), 13) == 12
    # Of the old prompt only its last block is left: no leading block, no hit.
    assert idx.cached_tokens("p0", block_hashes(old, BS), 13) == 0
    idx.record("p0", block_hashes(old, BS)[:1])  # used again: now the newest
    assert idx.cached_tokens("p0", block_hashes(old, BS), 13) == 4


def test_block_hashes_are_sha256_and_separate_tenants_by_salt():
    a = list(range(40))
    keys = block_hashes(a, BS)
    assert all(isinstance(k, bytes) and len(k) == 32 for k in keys)
    assert block_hashes(a, BS, "tenant-a") != keys
    assert block_hashes(a, BS, "tenant-a") == block_hashes(a, BS, "tenant-a")
    assert not set(block_hashes(a, BS, "tenant-a")) & set(block_hashes(a, BS, "tenant-b"))
