import pytest

from xllm_py.engine.block_pool import BlockPool, hash_block_tokens
from xllm_py.engine.kv_cache_manager import KVCacheManager
from xllm_py.request import Request
from xllm_py.sampling_params import SamplingParams


def make_manager(num_blocks: int = 9, block_size: int = 4, caching: bool = True):
    return KVCacheManager(BlockPool(num_blocks, block_size, caching))


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams())


def compute(manager: KVCacheManager, request: Request, num_tokens: int) -> None:
    """What the scheduler does after a step: advance computed tokens, cache full blocks."""
    request.num_computed_tokens += num_tokens
    manager.cache_full_blocks(request)


def test_allocate_exact_block_ids_and_free_order():
    m = make_manager()
    r = req("a", list(range(10)))
    assert m.get_computed_blocks(r) == ([], 0)
    assert m.allocate_slots(r, 10) == [1, 2, 3]
    assert r.block_ids == [1, 2, 3] and m.get_block_ids("a") == [1, 2, 3]
    compute(m, r, 10)
    # Growing within the last block needs nothing; crossing into a new one takes one.
    assert m.allocate_slots(r, 2) == []
    assert m.allocate_slots(r, 3) == [4]
    m.free(r)
    assert r.block_ids == [] and m.get_block_ids("a") == []
    # Freed tail first: the prefix (1, 2) is evicted last.
    assert m.block_pool.free_block_ids() == [5, 6, 7, 8, 4, 3, 2, 1]


def test_allocate_returns_none_without_side_effects():
    m = make_manager(num_blocks=4)  # 3 usable
    r = req("a", list(range(13)))
    assert m.allocate_slots(r, 13) is None
    assert r.block_ids == [] and m.num_free_blocks == 3
    assert m.allocate_slots(r, 12) == [1, 2, 3]


def test_prefix_hit_shares_running_request_blocks():
    m = make_manager()
    prefix = list(range(100, 108))  # two full blocks
    a = req("a", prefix + [1, 2, 3])
    m.allocate_slots(a, a.num_tokens)
    compute(m, a, a.num_tokens)
    assert a.block_hashes == [
        hash_block_tokens(None, prefix[:4]),
        hash_block_tokens(hash_block_tokens(None, prefix[:4]), prefix[4:]),
    ]
    b = req("b", prefix + [7])
    blocks, num_cached = m.get_computed_blocks(b)
    assert (blocks, num_cached) == ([1, 2], 8)
    assert m.allocate_slots(b, b.num_tokens - num_cached, blocks) == [4]
    assert b.block_ids == [1, 2, 4]
    assert m.block_pool.ref_count(1) == 2 and m.block_pool.ref_count(2) == 2
    assert m.block_pool.num_prefix_hit_tokens == 8
    assert m.block_pool.num_prefix_query_tokens == 11 + 9
    m.free(a)
    assert m.block_pool.ref_count(1) == 1 and m.block_pool.ref_count(3) == 0
    m.free(b)
    assert m.block_pool.num_free_blocks == 8


def test_hit_never_covers_the_whole_prompt():
    m = make_manager()
    tokens = list(range(8))  # exactly two blocks
    a = req("a", tokens)
    m.allocate_slots(a, 8)
    compute(m, a, 8)
    m.free(a)
    b = req("b", tokens)
    # Only the first block: the last token must be computed to get logits.
    assert m.get_computed_blocks(b) == ([1], 4)


def test_hit_on_freed_blocks_revives_them():
    m = make_manager(num_blocks=5)  # 4 usable
    a = req("a", list(range(9)))
    m.allocate_slots(a, 9)
    compute(m, a, 9)
    m.free(a)
    assert m.block_pool.free_block_ids() == [4, 3, 2, 1]
    b = req("b", list(range(8)) + [50, 51, 52, 53, 54, 55, 56, 57])
    blocks, n = m.get_computed_blocks(b)
    assert (blocks, n) == ([1, 2], 8)
    # Needs 2 new blocks + 2 revived from the free queue = all 4.
    assert m.allocate_slots(b, 8, blocks) == [4, 3]
    assert b.block_ids == [1, 2, 4, 3]
    assert m.num_free_blocks == 0


def test_revived_blocks_count_against_free_space():
    m = make_manager(num_blocks=4)  # 3 usable
    a = req("a", list(range(9)))
    m.allocate_slots(a, 9)
    compute(m, a, 9)
    m.free(a)
    b = req("b", list(range(8)) + list(range(60, 68)))
    blocks, n = m.get_computed_blocks(b)
    assert blocks == [1, 2]
    assert m.allocate_slots(b, 8, blocks) is None  # 2 revived + 2 new > 3 free
    assert m.num_free_blocks == 3 and b.block_ids == []


def test_partial_blocks_are_not_cached_and_chunks_cache_as_they_fill():
    m = make_manager()
    r = req("a", list(range(10)))
    m.allocate_slots(r, 6)
    compute(m, r, 6)
    assert m.block_pool.num_cached_blocks == 1
    m.allocate_slots(r, 4)
    compute(m, r, 4)
    assert m.block_pool.num_cached_blocks == 2
    assert m.block_pool.take_events() == (r.block_hashes, [])
    m.free(r)


def test_prefix_caching_disabled():
    m = make_manager(caching=False)
    a = req("a", list(range(9)))
    m.allocate_slots(a, 9)
    compute(m, a, 9)
    b = req("b", list(range(9)))
    assert m.get_computed_blocks(b) == ([], 0)
    assert m.block_pool.num_cached_blocks == 0
    m.free(a)


def test_bad_arguments():
    m = make_manager()
    r = req("a", [1, 2, 3])
    with pytest.raises(ValueError, match="num_new_tokens"):
        m.allocate_slots(r, -1)
    m.allocate_slots(r, 3)
    with pytest.raises(ValueError, match="first allocation"):
        m.allocate_slots(r, 1, [2])
