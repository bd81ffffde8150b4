"""Cache-aware routing: an engine's prefix-cache events (CacheEvents) -> the service's
PrefixIndex -> CacheAwarePolicy picks the instance holding the longest prompt prefix."""
from __future__ import annotations

import pytest

from xllm_py.cluster.instance_meta import InstanceMeta
from xllm_py.config import CacheConfig, EngineConfig, InstanceRole
from xllm_py.engine.cache_events import CacheEvents, hash_from_bytes, hash_to_bytes
from xllm_py.engine.llm_engine import EngineRequest, LLMEngine
from xllm_py.sampling_params import SamplingParams
from xllm_service.instance_table import InstanceInfo, InstanceState, LoadInfo
from xllm_service.prefix_index import PrefixIndex, prompt_block_hashes
from tests.unit.sinks import DoneSink
from xllm_service.router import CacheAwarePolicy, make_policy


class EventPool:
    """A block pool's prefix-cache events, set by the test (also used by test_registry)."""

    def __init__(self) -> None:
        self.events: tuple[list[int], list[int]] = ([], [])

    def take_events(self):
        events, self.events = self.events, ([], [])
        return events


def test_events_report_the_net_change_between_heartbeats():
    pool, events = EventPool(), CacheEvents()
    pool.events = ([1, 2, 3], [])
    events.collect(pool)
    pool.events = ([4], [2])  # 2 was never reported: nothing to take back
    events.collect(pool)
    stored, removed = events.drain()
    assert [hash_from_bytes(b) for b in stored] == [1, 3, 4] and removed == []
    pool.events = ([], [1])
    events.collect(pool)
    pool.events = ([1], [3])  # 1 removed and stored again before the heartbeat: no change
    events.collect(pool)
    assert events.drain() == ([], [hash_to_bytes(3)])
    assert events.drain() == ([], [])


def test_a_full_drain_is_everything_held_and_the_next_delta_starts_there():
    pool, events = EventPool(), CacheEvents()
    pool.events = ([1, 2, 3], [])
    events.collect(pool)
    assert len(events.drain()[0]) == 3
    pool.events = ([4], [2])
    events.collect(pool)
    stored, removed = events.drain(full=True)
    assert sorted(hash_from_bytes(b) for b in stored) == [1, 3, 4] and removed == []
    assert events.drain() == ([], [])
    pool.events = ([5], [1])
    events.collect(pool)
    assert events.drain() == ([hash_to_bytes(5)], [hash_to_bytes(1)])

    index = PrefixIndex()
    index.update("a", [hash_to_bytes(h) for h in (7, 8)], [])
    index.update("a", [hash_to_bytes(h) for h in (1, 3, 4)], [], full=True)
    assert [index.matched_blocks("a", [h]) for h in (7, 1, 3, 4)] == [0, 1, 1, 1]
    index.update("a", [], [], full=True)  # holds nothing now
    assert index.num_cached_blocks("a") == 0


@pytest.mark.integration
def test_the_service_hashes_a_prompt_as_the_engine_caches_it():
    engine = LLMEngine(EngineConfig(model="tiny", cache=CacheConfig(block_size=8)))
    engine.start()
    try:
        prompt = list(range(10, 47))  # 4 full blocks of 8 and 5 tokens
        sink = DoneSink()
        engine.submit(EngineRequest("r", prompt, SamplingParams(max_tokens=2, ignore_eos=True,
                                                                temperature=0.0), sink))
        assert sink.done.wait(30)
        events = CacheEvents()
        engine.call(lambda: events.collect(engine.scheduler.kv.block_pool)).result(10)
        stored = {hash_from_bytes(b) for b in events.drain()[0]}
    finally:
        engine.stop()
    chain = prompt_block_hashes(prompt, 8)
    assert len(chain) == 4 and set(chain) <= stored


def _info(name: str, waiting: int = 0, block_size: int = 4) -> InstanceInfo:
    return InstanceInfo(InstanceMeta(name=name, type=InstanceRole.MIX, block_size=block_size),
                        InstanceState.ACTIVE, 0.0, load=LoadInfo(waiting=waiting))


class _Req:
    def __init__(self, prompt: list[int]) -> None:
        self.prompt_token_ids = prompt


def test_index_and_policy_route_to_the_longest_cached_prefix():
    index = PrefixIndex()
    shared, other = list(range(100, 112)), list(range(200, 212))
    a, b = _info("a"), _info("b")
    index.update("b", [hash_to_bytes(h) for h in prompt_block_hashes(shared, 4)], [])
    index.update("a", [hash_to_bytes(h) for h in prompt_block_hashes(shared, 4)[:1]], [])
    assert index.matched_blocks("b", prompt_block_hashes(shared + [1, 2, 3, 4], 4)) == 3
    assert index.matched_blocks("a", prompt_block_hashes(shared, 4)) == 1
    policy = make_policy("CACHE_AWARE", lambda n: 0, index)
    assert isinstance(policy, CacheAwarePolicy)
    assert policy.select([a, b], _Req(shared + [7])).name == "b"
    # No hit anywhere, or no prompt: least load, then name.
    assert policy.select([_info("a", waiting=2), b], _Req(other)).name == "b"
    assert policy.select([a, b]).name == "a"
    # A hit does not pull work onto an instance far busier than the least loaded.
    assert policy.select([a, _info("b", waiting=5)], _Req(shared)).name == "a"
    assert policy.select([a, _info("b", waiting=3)], _Req(shared)).name == "b"
    # Removed blocks and evicted instances stop counting.
    index.update("b", [], [hash_to_bytes(prompt_block_hashes(shared, 4)[0])])
    assert index.matched_blocks("b", prompt_block_hashes(shared, 4)) == 0
    index.forget("a")
    assert policy.select([a, b], _Req(shared)).name == "a"  # tie at 0 hits: by name
