"""KV groups by attention type (model/kv_groups.py) and HybridKVCacheManager: sliding
groups hold only their window (the rest back in the pool while the request runs), hits
are used only where every group has what the next token reads, the service hears of a
block only while every group holds it, a hand-over lists only the window's blocks."""
from __future__ import annotations

import pytest

from xllm_py.config import CacheConfig, SchedulerConfig
from xllm_py.engine.block_pool import NULL_BLOCK_ID, BlockPool, hash_block_tokens
from xllm_py.engine.hybrid_kv import HybridKVCacheManager, group_hash
from xllm_py.engine.scheduler import ContinuousScheduler
from xllm_py.model.kv_groups import kv_groups
from xllm_py.request import Request
from xllm_py.sampling_params import SamplingParams

BS = 4
W = 6  # a window shorter than two blocks
WINDOWS = (0, W, W)  # group 0 full, two sliding groups


def _manager(num_blocks: int = 64, caching: bool = True) -> HybridKVCacheManager:
    return HybridKVCacheManager(BlockPool(num_blocks, BS, caching, num_groups=3), WINDOWS)


def _req(rid: str, n: int, start: int = 100) -> Request:
    return Request(rid, list(range(start, start + n)), SamplingParams(max_tokens=8))


def _held(table: list[int]) -> list[int]:
    return [i for i, b in enumerate(table) if b != NULL_BLOCK_ID]


def test_groups_of_gemma3_270m_and_of_one_type():
    windows = [512 if (i + 1) % 6 else 0 for i in range(18)]  # layers 5, 11, 17 full
    g = kv_groups(windows)
    assert g.num_slots == 3 and g.group_windows == (0, 512, 512, 512, 512, 512)
    assert [g.layer_group[i] for i in (5, 11, 17)] == [0, 0, 0]
    assert [g.layer_slot[i] for i in (5, 11, 17)] == [0, 1, 2]
    for j in range(1, 6):  # each sliding group: three layers, one per slot
        assert sorted(g.layer_slot[i] for i in range(18) if g.layer_group[i] == j) == [0, 1, 2]
    plain = kv_groups([0] * 4)
    assert (plain.num_slots, plain.group_windows, plain.layer_slot) == (4, (0,), (0, 1, 2, 3))
    assert plain.layer_caches("abcd") == list("abcd")


def test_a_pipeline_stage_pools_only_the_slots_of_its_layers():
    windows = [512 if (i + 1) % 6 else 0 for i in range(18)]  # gemma-3-270m
    model = kv_groups(windows)
    sliding = model.stage(0, 2)  # layers 0, 1: sliding, group 1's slots 0 and 1
    assert (sliding.num_slots, sliding.slots, sliding.layer_slot) == (2, (0, 1), (0, 1))
    assert sliding.layer_group == (1, 1) and sliding.group_windows == model.group_windows
    full = model.stage(17, 18)  # the last full layer: slot 2 alone
    assert (full.num_slots, full.slots, full.layer_slot, full.layer_group) == (1, (2,), (0,), (0,))
    both = model.stage(4, 12)  # sliding groups 1..3 and full layers 5, 11
    assert both.slots == (0, 1, 2) and both.layer_group == model.layer_group[4:12]
    assert both.layer_caches("abc") == [("abc")[model.layer_slot[i]] for i in range(4, 12)]
    plain = kv_groups([0] * 4).stage(1, 3)  # one type: the stage's layers, in order
    assert (plain.num_slots, plain.slots, plain.layer_slot) == (2, (1, 2), (0, 1))


def test_sliding_groups_keep_only_the_window_while_running():
    kv = _manager()
    r = _req("a", 20)
    assert kv.allocate_slots(r, 20) is not None  # the prompt in one chunk: 5 blocks each
    tables = kv.tables(r)
    assert [len(t) for t in tables] == [5, 5, 5] and all(_held(t) == [0, 1, 2, 3, 4] for t in tables)
    r.num_computed_tokens = 20
    r.append_output_token(1)
    used_before = kv.block_pool.num_used_blocks
    assert kv.allocate_slots(r, 1) is not None  # position 20 reads 15..20: blocks 3..5
    assert _held(tables[0]) == list(range(6))
    assert _held(tables[1]) == _held(tables[2]) == [3, 4, 5]
    assert kv.block_pool.num_used_blocks == used_before + 3 - 6
    for pos in range(21, 40):  # decoding on: never more than ceil(W / B) + 1 per sliding group
        r.num_computed_tokens = pos
        r.append_output_token(1)
        if pos % BS == 0:
            assert kv.allocate_slots(r, 1) is not None
        assert len(_held(tables[1])) <= -(-W // BS) + 1
    assert kv.held_blocks() == {"full": 10, "sliding": 2 * len(_held(tables[1]))}
    kv.free(r)
    assert kv.block_pool.num_used_blocks == 0 and r.block_ids == [] == r.group_block_ids[0]


def test_need_is_summed_over_groups_and_nothing_changes_when_short():
    kv = _manager(num_blocks=1 + 8)  # 8 usable: a 12-token prompt needs 3 x 3 blocks
    r = _req("a", 12)
    assert kv.allocate_slots(r, 12) is None
    assert r.block_ids == [] and kv.block_pool.num_free_blocks == 8
    assert kv.allocate_slots(r, 8) is not None  # a chunk of 8: 2 x 3 blocks
    assert kv.block_pool.num_free_blocks == 2


def test_prefix_hit_past_the_window_takes_only_the_window():
    kv = _manager()
    a = _req("a", 21)
    kv.allocate_slots(a, 21)
    a.num_computed_tokens = 21
    kv.cache_full_blocks(a)
    kv.free(a)
    b = _req("b", 23)  # shares a's 21 tokens: 5 full blocks cached in every group
    hits, n = kv.get_computed_blocks(b)
    assert n == 20
    # the token at 20 reads 15..20: sliding groups take blocks 3, 4 of the hit
    assert [_held(h) for h in hits] == [[0, 1, 2, 3, 4], [3, 4], [3, 4]]
    assert kv.allocate_slots(b, 3, hits) is not None
    assert _held(b.group_block_ids[0]) == [3, 4, 5] and _held(b.block_ids) == list(range(6))
    assert kv.block_pool.num_prefix_hit_tokens == 20


def test_hit_shrinks_to_where_the_sliding_window_is_cached():
    kv = _manager()
    a = _req("a", 21)
    kv.allocate_slots(a, 21)
    a.num_computed_tokens = 21
    kv.cache_full_blocks(a)
    hashes = list(a.block_hashes)
    kv.free(a)
    pool = kv.block_pool
    # evict sliding group 2's block 3: a hit at 20 (reads blocks 3, 4) is no longer whole
    victim = pool.get_cached_block(group_hash(hashes[3], 2))
    pool.touch([victim])
    pool.free_blocks([victim])
    pool._free_queue.move_to_end(victim, last=False)
    pool.get_new_blocks(1)
    _, n = kv.get_computed_blocks(_req("b", 23))
    assert n == 12  # at 12 the window (blocks 1, 2) is whole in every group


def test_events_report_a_block_only_while_every_group_holds_it():
    kv = _manager()
    a = _req("a", 8)
    kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    kv.cache_full_blocks(a)
    stored, removed = kv.block_pool.take_events()
    h0 = hash_block_tokens(None, a.all_token_ids[:4])
    assert stored == [h0, a.block_hashes[1]] and removed == []
    kv.free(a)
    pool = kv.block_pool
    pool.get_new_blocks(pool.num_free_blocks)  # evicts everything
    stored, removed = pool.take_events()
    assert stored == [] and sorted(removed) == sorted([h0, a.block_hashes[1]])


def test_handover_lists_full_prompt_and_sliding_window():
    kv = _manager()
    tables = [list(range(10, 16)), [0, 0, 0, 23, 24, 25], [0, 0, 0, 33, 34, 35]]
    # a 21-token prompt: the decode's first token (at 21) reads 16..20: blocks 4, 5
    assert kv.handover_block_ids(tables, 0, 21) == [10, 11, 12, 13, 14, 15, 24, 25, 34, 35]
    assert kv.handover_block_ids(tables, 20, 21) == [15, 25, 35]
    # each group's share of the list, in order (a hand-over split by group: KVMove)
    assert kv.handover_group_sizes(0, 21) == [6, 2, 2]
    assert kv.handover_group_sizes(20, 21) == [1, 1, 1]


def test_decode_allocates_only_the_window_for_a_remote_prompt():
    sched = ContinuousScheduler(SchedulerConfig(), CacheConfig(block_size=BS), num_blocks=64,
                                group_windows=WINDOWS)
    r = _req("a", 21)
    alloc = sched.remote.allocate_for_remote(r)
    assert len(r.block_ids) == 6 and _held(r.group_block_ids[0]) == [4, 5]
    assert len(alloc.new_block_ids) == 6 + 2 + 2  # prompt blocks 0..5, sliding 4, 5
    assert sched.kv.block_pool.num_used_blocks == 6 + 2 * 2
    sched.abort_request("a")
    assert sched.kv.block_pool.num_used_blocks == 0


def test_prefill_keeps_only_the_window_while_sending():
    sched = ContinuousScheduler(SchedulerConfig(max_num_batched_tokens=64), CacheConfig(block_size=BS),
                                num_blocks=64, group_windows=WINDOWS)
    r = Request("a", list(range(100, 121)), SamplingParams(max_tokens=8), remote_decode=True)
    sched.add_request(r)
    out = sched.schedule()
    assert out.seqs[0].group_tables is not None and len(out.seqs[0].group_tables) == 2
    sched.update_from_output(out, {"a": 7})
    assert _held(r.group_block_ids[0]) == _held(r.group_block_ids[1]) == [4, 5]
    assert sched.remote.finish_sending("a")
    assert sched.kv.block_pool.num_used_blocks == 0


@pytest.mark.parametrize("chunk", [4, 64])
def test_one_request_may_use_more_than_the_pool_over_the_groups(chunk):
    kv = _manager(num_blocks=1 + 30)
    longest = kv.max_tokens_for_one(chunk)
    cap = -(-(W - 1 + chunk) // BS) + 1
    assert longest // BS + 2 * min(longest // BS, cap) <= 30
    assert longest >= 30 // 3 * BS  # never worse than every group holding everything


def test_pool_metric_says_what_each_type_holds():
    from prometheus_client import CollectorRegistry, generate_latest

    from xllm_py.engine.metrics import EngineStatsCollector

    kv = _manager()
    r = _req("a", 21)
    kv.allocate_slots(r, 21, first_pos=21)  # as a decode takes it: sliding keeps blocks 4, 5

    class _Engine:
        scheduler = type("S", (), {"kv": kv})()
        speculator = None

        def stats(self):
            return {}

    registry = CollectorRegistry()
    registry.register(EngineStatsCollector(_Engine()))
    text = generate_latest(registry).decode()
    assert 'xllm_kv_cache_blocks_held{attention="full"} 6.0' in text
    assert 'xllm_kv_cache_blocks_held{attention="sliding"} 4.0' in text


def test_decode_hit_then_remote_prompt_takes_the_window_of_its_end():
    """A decode with a prefix hit of 20 tokens takes a 33-token prompt from a peer: the
    full group shares 5 blocks and gets 4 new; sliding groups hold only the blocks the
    token at 33 reads (7, 8), none of the hit's; the hand-over lists blocks 5..8 of the
    full group and 7, 8 of each sliding group."""
    sched = ContinuousScheduler(SchedulerConfig(), CacheConfig(block_size=BS), num_blocks=64,
                                group_windows=WINDOWS)
    a = Request("a", list(range(100, 121)), SamplingParams(max_tokens=1))
    sched.add_request(a)
    out = sched.schedule()
    sched.update_from_output(out, {"a": 7})  # done (max_tokens 1): its blocks cached
    b = Request("b", list(range(100, 133)), SamplingParams(max_tokens=8))
    alloc = sched.remote.allocate_for_remote(b)
    assert alloc.num_cached_tokens == 20
    assert len(b.block_ids) == 9 and all(_held(t) == [7, 8] for t in b.group_block_ids)
    assert alloc.new_block_ids == (b.block_ids[5:9] + b.group_block_ids[0][7:9]
                                   + b.group_block_ids[1][7:9])
    assert sched.kv.block_pool.num_used_blocks == 9 + 2 * 2
    sched.abort_request("b")
    assert sched.kv.block_pool.num_used_blocks == 0


def test_preemption_frees_every_group_and_the_recompute_is_exact():
    """Two requests decode in a pool too small for both: the later one is preempted, its
    blocks in every group go back (the pool then holds only the survivor's), it is
    recomputed from prompt + outputs when room comes back, and both end with the tokens
    of a run in a pool large enough; the pool ends empty."""
    from tests.unit.sched_utils import FakeRunner, assert_scheduler_empty, create_requests

    def run(num_blocks: int):
        sched = ContinuousScheduler(
            SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4, max_model_len=64),
            CacheConfig(block_size=BS), num_blocks=num_blocks, group_windows=WINDOWS)
        assert sched.max_model_len >= 40  # one request alone always fits
        for r in create_requests(2, 10, max_tokens=30):
            sched.add_request(r)
        runner, outputs, preempted = FakeRunner(BS), {"req-0": [], "req-1": []}, []
        for _ in range(500):
            if not sched.has_schedulable_requests():
                break
            out = sched.schedule()
            for rid in out.preempted_ids:
                victim = sched.get_request(rid)
                assert victim.block_ids == [] and all(g == [] for g in victim.group_block_ids)
                held = sum(len(_held(t)) for t in sched.kv.tables(sched.get_request("req-0")))
                assert sched.kv.block_pool.num_used_blocks == held
                preempted.append(rid)
            for u in sched.update_from_output(out, runner.step(out)):
                outputs[u.request_id] += u.new_token_ids
        assert_scheduler_empty(sched)
        return outputs, preempted

    roomy, none = run(1 + 64)
    tight, preempted = run(1 + 24)  # 10 + 30 tokens: 10 full blocks + 2 x 2-3 sliding each
    assert none == [] and set(preempted) == {"req-1"}
    assert tight == roomy and all(len(t) == 30 for t in tight.values())


@pytest.mark.parametrize("remote", [False, True])
def test_new_blocks_never_take_a_hit_block_from_the_free_queue(remote):
    """A's cached blocks sit at the free-queue head (freed before C's), the pool holds no
    other free block: B's prefix hit revives them and its new blocks are C's, never a
    hit block handed out again (it would be overwritten while B reads it as the hit),
    as a prefill takes it (its own hit) and as a decode takes a peer's prompt."""
    kv = _manager(num_blocks=1 + 9)
    a, c = _req("a", 8), _req("c", 4, start=500)
    kv.allocate_slots(a, 8)
    kv.allocate_slots(c, 4)
    a.num_computed_tokens = 8
    kv.cache_full_blocks(a)
    a_ids = {blk for t in kv.tables(a) for blk in t}
    kv.free(a)
    kv.free(c)
    pool = kv.block_pool
    assert set(pool.free_block_ids()[:6]) == a_ids and pool.num_free_blocks == 9
    b = _req("b", 12)  # a's 8 tokens and 4 more: a hit of 2 blocks in every group
    hits, n = kv.get_computed_blocks(b)
    assert n == 8 and all(_held(h) == [0, 1] for h in hits)
    assert kv.allocate_slots(b, 4, hits, first_pos=12 if remote else None) is not None
    # (a decode's first token at 12 reads 7..12: sliding groups leave hit block 0)
    taken = [[blk if i >= (1 if remote and j else 0) else NULL_BLOCK_ID
              for i, blk in enumerate(h)] for j, h in enumerate(hits)]
    assert [t[:2] for t in kv.tables(b)] == taken
    held = [blk for t in kv.tables(b) for blk in t if blk != NULL_BLOCK_ID]
    assert len(held) == len(set(held)) == pool.num_used_blocks
    assert all(pool.ref_count(blk) == 1 for blk in held)
    assert all(pool.block_hash(blk) is not None for t in taken for blk in t if blk)
