import pytest

from engine.block_manager import BlockManager, OutOfBlocksError


def test_allocate_free_exact_ids_and_order():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = bm.allocate(2)
    b = bm.allocate(3)
    assert a == [0, 1] and b == [2, 3, 4]
    assert bm.num_free_blocks == 1
    bm.free(a)
    # Freed blocks go to the back of the queue, after the never-used block 5.
    assert list(bm._free) == [5, 0, 1]
    assert bm.allocate(2) == [5, 0]
    bm.check_integrity()


def test_refcounts_and_out_of_blocks():
    bm = BlockManager(num_blocks=3, block_size=2)
    ids = bm.allocate(2)
    bm.incref(ids)
    bm.free(ids)
    assert bm.num_free_blocks == 1  # still referenced once
    with pytest.raises(OutOfBlocksError):
        bm.allocate(2)
    bm.free(ids)
    assert bm.num_free_blocks == 3
    assert bm.blocks_for_tokens(5) == 3 and bm.blocks_for_tokens(4) == 2
    bm.check_integrity()


def test_integrity_check_catches_leak_and_double_free():
    bm = BlockManager(num_blocks=4, block_size=2)
    ids = bm.allocate(1)
    bm._ref_counts[ids[0]] = 0  # simulate a leak: neither free nor referenced
    with pytest.raises(AssertionError):
        bm.check_integrity()
    bm2 = BlockManager(num_blocks=2, block_size=2)
    x = bm2.allocate(1)
    bm2.free(x)
    with pytest.raises(AssertionError):
        bm2.free(x)


def test_allocate_contiguous_takes_the_lowest_run():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = bm.allocate(10)
    bm.free([a[7], a[2], a[3], a[8], a[9], a[5]])  # free: 7 2 3 8 9 5 -> runs [2,3] [5] [7,8,9]
    assert bm.allocate_contiguous(4) is None
    assert bm.allocate_contiguous(3) == [7, 8, 9]
    assert bm.allocate_contiguous(2) == [2, 3]
    assert list(bm._free) == [5]  # what is left keeps its queue order
    bm.check_integrity()
    bm.free([0, 1, 2, 3, 4, 6, 7, 8, 9])
    bm.check_integrity()
    assert bm.num_free_blocks == 10


def test_allocate_contiguous_prefers_the_queue_front():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = bm.allocate(3)  # free queue: 3 4 5 6 7
    assert bm.allocate_contiguous(2) == [3, 4]  # the front is a run: taken as allocate() would
    bm.free(a)  # free queue: 5 6 7 0 1 2
    assert bm.allocate_contiguous(4) is None  # no run of 4: 5-7 and 0-2
    assert bm.allocate_contiguous(3) == [5, 6, 7]
    bm.free([3, 4, 5, 6, 7])
    bm.check_integrity()
    assert bm.num_free_blocks == 8


def test_prefix_cache_keeps_freed_blocks_until_they_are_reallocated():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = bm.allocate(2)  # [0, 1]
    bm.register(a[0], "k0")
    bm.register(a[1], "k1")
    bm.register(a[1], "other")  # a block has one key
    assert bm.lookup(["k0", "k1", "k2"]) == [0, 1]
    assert bm.lookup(["k1"]) == [1] and bm.lookup(["nope", "k1"]) == []  # a prefix, from the start
    bm.free(a)
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2  # cached blocks count as free
    assert list(bm._free) == [2, 3, 0, 1]
    # Taking cached blocks back revives them out of the middle of the queue.
    assert bm.num_free_after_taking([0]) == 3
    bm.take([0])
    bm.take([0])  # a second request sharing it
    assert list(bm._free) == [2, 3, 1]
    bm.check_integrity()
    # Allocation hands out the queue's front; a cached block handed out loses its key.
    assert bm.allocate(3) == [2, 3, 1]
    assert bm.lookup(["k0", "k1"]) == [0] and bm.num_cached_blocks == 1
    bm.check_integrity()
    bm.free([0])
    assert bm.num_free_blocks == 0  # still referenced once
    bm.free([0, 2, 3, 1])
    bm.reset_prefix_cache()
    assert bm.lookup(["k0"]) == [] and bm.num_free_blocks == 4
    bm.check_integrity()
