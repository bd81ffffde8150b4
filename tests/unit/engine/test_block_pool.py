import pytest

from xllm_py.engine.block_pool import BlockPool, hash_block_tokens


def test_initial_state_reserves_block_zero():
    pool = BlockPool(num_blocks=5, block_size=4)
    assert pool.free_block_ids() == [1, 2, 3, 4]
    assert pool.num_usable_blocks == 4
    assert pool.num_free_blocks == 4 and pool.num_used_blocks == 0 and pool.usage == 0.0


def test_allocation_takes_from_head_and_free_appends_to_tail():
    pool = BlockPool(num_blocks=6, block_size=4)
    assert pool.get_new_blocks(2) == [1, 2]
    assert pool.get_new_blocks(1) == [3]
    assert pool.free_block_ids() == [4, 5]
    assert pool.num_used_blocks == 3 and pool.usage == pytest.approx(3 / 5)
    pool.free_blocks([3, 1])
    assert pool.free_block_ids() == [4, 5, 3, 1]
    assert pool.get_new_blocks(3) == [4, 5, 3]
    assert pool.free_block_ids() == [1]


def test_ref_counts_and_touch():
    pool = BlockPool(num_blocks=4, block_size=2)
    [b] = pool.get_new_blocks(1)
    pool.touch([b])
    assert pool.ref_count(b) == 2
    pool.free_blocks([b])
    assert pool.ref_count(b) == 1 and b not in pool.free_block_ids()
    pool.free_blocks([b])
    assert pool.ref_count(b) == 0 and pool.free_block_ids()[-1] == b
    with pytest.raises(ValueError, match="freed more times"):
        pool.free_blocks([b])


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(1, 4)
    pool = BlockPool(3, 4)
    with pytest.raises(ValueError, match="only 2 free"):
        pool.get_new_blocks(3)
    with pytest.raises(ValueError, match="out of range"):
        pool.touch([0])
    with pytest.raises(ValueError, match="out of range"):
        pool.free_blocks([3])


def test_hash_is_stable_and_chained():
    h1 = hash_block_tokens(None, [1, 2, 3, 4])
    assert h1 == hash_block_tokens(None, (1, 2, 3, 4))
    # A fixed value: the hash must be identical across processes (no PYTHONHASHSEED).
    assert h1 == int.from_bytes(
        __import__("hashlib").sha256(repr((None, (1, 2, 3, 4))).encode()).digest()[:8], "big"
    )
    assert hash_block_tokens(h1, [5, 6, 7, 8]) != hash_block_tokens(None, [5, 6, 7, 8])
    assert hash_block_tokens(None, [1, 2, 3, 5]) != h1


def test_cached_block_revived_from_free_queue_on_hit():
    pool = BlockPool(num_blocks=5, block_size=2)
    a, b = pool.get_new_blocks(2)
    h = hash_block_tokens(None, [1, 2])
    assert pool.cache_block(a, h) is True
    pool.free_blocks([b, a])
    assert pool.free_block_ids() == [3, 4, 2, 1]
    assert pool.get_cached_block(h) == a
    pool.touch([a])  # prefix hit: leaves the free queue
    assert pool.free_block_ids() == [3, 4, 2]
    assert pool.ref_count(a) == 1
    assert pool.block_hash(a) == h


def test_lru_eviction_drops_hash():
    pool = BlockPool(num_blocks=4, block_size=2)
    blocks = pool.get_new_blocks(3)
    hashes = [hash_block_tokens(None, [i, i]) for i in range(3)]
    for block, h in zip(blocks, hashes):
        pool.cache_block(block, h)
    pool.free_blocks([2, 1, 3])  # 2 least recently freed
    assert pool.free_block_ids() == [2, 1, 3]
    assert pool.get_new_blocks(1) == [2]  # evicts the cached block 2
    assert pool.get_cached_block(hashes[1]) is None
    assert pool.block_hash(2) is None
    assert pool.get_cached_block(hashes[0]) == 1
    assert pool.get_cached_block(hashes[2]) == 3
    assert pool.num_cached_blocks == 2


def test_duplicate_content_keeps_first_block():
    pool = BlockPool(num_blocks=4, block_size=2)
    a, b = pool.get_new_blocks(2)
    h = hash_block_tokens(None, [1, 2])
    assert pool.cache_block(a, h) is True
    assert pool.cache_block(b, h) is False
    assert pool.get_cached_block(h) == a and pool.block_hash(b) is None


def test_events_are_net_changes():
    pool = BlockPool(num_blocks=4, block_size=2)
    a, b = pool.get_new_blocks(2)
    ha, hb = hash_block_tokens(None, [1, 1]), hash_block_tokens(None, [2, 2])
    pool.cache_block(a, ha)
    pool.cache_block(b, hb)
    assert pool.take_events() == ([ha, hb], [])
    assert pool.take_events() == ([], [])
    pool.free_blocks([a, b])
    assert pool.free_block_ids() == [3, 1, 2]
    pool.get_new_blocks(2)  # 3, then evicts a
    assert pool.take_events() == ([], [ha])
    # stored then evicted before a drain: no event at all
    [c] = pool.get_new_blocks(1)  # evicts b
    hc = hash_block_tokens(None, [3, 3])
    pool.cache_block(c, hc)
    pool.free_blocks([c])
    assert pool.get_new_blocks(1) == [c]
    assert pool.take_events() == ([], [hb])


def test_prefix_caching_disabled():
    pool = BlockPool(num_blocks=3, block_size=2, enable_prefix_caching=False)
    [a] = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [1, 2])
    assert pool.cache_block(a, h) is False
    assert pool.get_cached_block(h) is None
    assert pool.take_events() == ([], [])
