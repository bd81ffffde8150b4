"""The KV tiers' side of the scheduler and the KV managers (pure Python): blocks cached are
logged for the tiers with a reference held until released (a sliding group's only where
a hit may end: the prompt's end and the request's); a request waiting for its lookup is
not admitted and does not keep the loop busy; a staged prefix is admitted as computed
tokens, its blocks set aside and listed for loading, exactly where the pool ends; the
service's index continues a prompt's match in an instance's tiers and in the store."""
from __future__ import annotations

import types

from xllm_py.config import CacheConfig, SchedulerConfig
from xllm_py.engine.block_pool import BlockPool
from xllm_py.engine.cache_events import hash_to_bytes
from xllm_py.engine.hybrid_kv import HybridKVCacheManager
from xllm_py.engine.kv_cache_manager import KVCacheManager
from xllm_py.engine.scheduler import ContinuousScheduler
from xllm_py.request import Request
from xllm_py.sampling_params import SamplingParams
from xllm_service.prefix_index import PrefixIndex

BS = 4


def _req(rid: str, n: int, start: int = 100) -> Request:
    return Request(rid, list(range(start, start + n)), SamplingParams(max_tokens=4))


def _staged(first: int, last: int, blocks) -> types.SimpleNamespace:
    return types.SimpleNamespace(first_block=first, num_blocks=last,
                                 data={b: f"bytes{b}".encode() for b in blocks})


def test_cached_blocks_are_logged_with_a_reference_until_released():
    kv = KVCacheManager(BlockPool(16, BS))
    kv.enable_offload()
    r = _req("a", 10)
    kv.allocate_slots(r, 10)
    r.num_computed_tokens = 10
    kv.cache_full_blocks(r)
    logged = kv.take_offloads()
    assert [(b, g) for b, g, _ in logged] == [(r.block_ids[0], 0), (r.block_ids[1], 0)]
    kv.free(r)
    assert kv.block_pool.num_used_blocks == 2  # held for the copy
    kv.release_offloads(logged)
    assert kv.block_pool.num_used_blocks == 0 and kv.take_offloads() == []


def test_a_hybrid_request_logs_its_windows_at_the_prompt_end_and_at_its_end():
    kv = HybridKVCacheManager(BlockPool(64, BS, num_groups=2), (0, 6))
    kv.enable_offload()
    r = _req("a", 18)  # prompt: 4 full blocks
    kv.allocate_slots(r, 18)
    r.num_computed_tokens = 18
    kv.cache_full_blocks(r)
    items = kv.take_offloads()
    full = sorted(i for i, (b, g, h) in enumerate(items) if g == 0)
    sliding = [(g, r.block_hashes.index(h)) for b, g, h in items if g == 1]
    assert len(full) == 4
    assert sliding == [(1, 2), (1, 3)]  # the window (6) before position 16: blocks 2, 3
    kv.release_offloads(items)
    for t in range(4):  # 4 tokens more: 5 full blocks, then the request ends
        r.append_output_token(7)
        kv.allocate_slots(r, 1)
        r.num_computed_tokens += 1
        kv.cache_full_blocks(r)
    kv.release_offloads(kv.take_offloads())
    kv.free(r)
    ends = [(g, r.block_hashes.index(h)) for b, g, h in kv.take_offloads() if g == 1]
    assert ends == [(1, 3), (1, 4)]  # before position 20


def test_a_request_waiting_for_its_lookup_is_passed_over_and_the_loop_may_sleep():
    s = ContinuousScheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4),
                            CacheConfig(block_size=BS, num_blocks=32))
    a, b = _req("a", 10), _req("b", 6, start=300)
    a.tier_pending = True
    s.add_request(a)
    assert not s.has_schedulable_requests()
    s.add_request(b)
    out = s.schedule()
    assert [q.request_id for q in out.seqs] == ["b"] and list(s.waiting) == [a]
    a.tier_pending = False
    assert [q.request_id for q in s.schedule().seqs] == ["b", "a"]


def test_a_staged_prefix_is_admitted_as_computed_and_its_blocks_listed_for_loading():
    s = ContinuousScheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4),
                            CacheConfig(block_size=BS, num_blocks=32))
    warm = _req("warm", 9)  # the pool: its first 2 blocks
    s.add_request(warm)
    out = s.schedule()
    s.update_from_output(out, {"warm": 1})
    s.abort_request("warm")
    r = _req("r", 23)  # 5 full blocks before its last token
    r.tier_prefix = _staged(2, 5, [(0, 2), (0, 3), (0, 4)])
    s.add_request(r)
    out = s.schedule()
    (seq,) = out.seqs
    assert seq.start_pos == 20 and len(seq.token_ids) == 3  # only the rest is computed
    assert [b for b, _ in out.loads] == r.block_ids[2:5]
    assert [d for _, d in out.loads] == [b"bytes(0, 2)", b"bytes(0, 3)", b"bytes(0, 4)"]
    assert r.num_cached_tokens == 20 and r.tier_prefix is None


def test_a_staged_prefix_behind_a_gap_in_the_pool_is_not_used():
    s = ContinuousScheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4),
                            CacheConfig(block_size=BS, num_blocks=32))
    r = _req("r", 23)
    r.tier_prefix = _staged(2, 5, [(0, 2), (0, 3), (0, 4)])  # looked up after 2 pool blocks
    s.add_request(r)  # ... which the pool no longer has
    out = s.schedule()
    assert out.loads == [] and out.seqs[0].start_pos == 0 and r.num_cached_tokens == 0


def test_the_index_continues_a_match_in_the_tiers_and_the_store():
    index = PrefixIndex()
    h = [hash_to_bytes(x) for x in range(1, 7)]
    index.update("a", h[:4], [])
    index.update("a", [], h[2:4])  # its pool let blocks 3, 4 go: in its tiers now
    index.update("b", h[4:6], [])  # another instance's pool holds 5, 6

    def info(name, tiers):
        meta = types.SimpleNamespace(kv_tiers={"tiers": tiers, "store_scope": "s/ns"})
        return types.SimpleNamespace(name=name, meta=meta)

    hashes = list(range(1, 7))
    index.matched(info("b", ["host", "store"]), hashes)  # (b shares the store)
    assert index.matched(info("a", ["host", "disk", "store"]), hashes) == (2, {"local": 2, "store": 2})
    assert index.matched(info("a", ["host"]), hashes) == (2, {"local": 2, "store": 0})
    assert index.matched(info("a", []), hashes) == (2, {})
