"""KVStream (engine/pd/kv_stream.py): a prompt's final blocks pushed as chunks finish, one
push at a time, coalescing what became final meanwhile; what was pushed counts at the
hand-over only while nothing can have made it stale. Its pushes are a fake that records
them and waits to be released."""
from __future__ import annotations

import asyncio

from xllm_py.engine.pd.kv_stream import KVStream

BS = 4


class Pushes:
    def __init__(self) -> None:
        self.calls: list[tuple[list[int], list[int]]] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail = False

    async def __call__(self, src, dst) -> None:
        self.calls.append((list(src), list(dst)))
        await self.gate.wait()
        if self.fail:
            raise ConnectionError("peer lost")


def stream(pushes: Pushes, first_block: int = 0, slots: int = 2) -> KVStream:
    decode_blocks = [100 + i for i in range(6)]
    return KVStream("r1", pushes, decode_blocks, first_block, BS, asyncio.Semaphore(slots),
                    asyncio.ensure_future)


TABLE = [10, 11, 12, 13, 14, 15]  # prompt of 22 tokens: 6 blocks, the last partial


async def test_each_finished_chunk_is_pushed_and_only_the_rest_is_left_at_the_first_token():
    pushes = Pushes()
    s = stream(pushes)
    s.computed(TABLE[:2], 8)  # chunk 1: blocks 0, 1 final
    await asyncio.sleep(0)
    s.computed(TABLE[:4], 14)  # chunk 2: 14 tokens, blocks 2 final (3 is partial)
    await asyncio.sleep(0.01)
    assert await s.finish(TABLE) == 3
    assert pushes.calls == [([10, 11], [100, 101]), ([12], [102])]


async def test_at_the_first_token_what_is_not_in_flight_is_left_to_the_last_push():
    pushes = Pushes()
    s = stream(pushes)
    s.computed(TABLE[:2], 8)
    await asyncio.sleep(0)  # push of blocks 0, 1 in flight
    s.computed(TABLE[:4], 14)
    assert await s.finish(TABLE) == 2  # block 2 goes with the last chunk's, in one push
    assert pushes.calls == [([10, 11], [100, 101])]


async def test_chunks_finished_while_a_push_is_in_flight_go_in_one_push():
    pushes = Pushes()
    pushes.gate.clear()
    s = stream(pushes)
    s.computed(TABLE[:1], 4)
    await asyncio.sleep(0)  # push of block 0 in flight
    s.computed(TABLE[:3], 12)
    s.computed(TABLE[:5], 20)
    pushes.gate.set()
    await asyncio.sleep(0.01)
    assert await s.finish(TABLE) == 5
    assert pushes.calls == [([10], [100]), ([11, 12, 13, 14], [101, 102, 103, 104])]


async def test_blocks_the_decode_had_cached_are_skipped():
    pushes = Pushes()
    s = stream(pushes, first_block=2)  # decode cached 8 tokens: its blocks start at ours 2
    s.computed(TABLE[:4], 16)
    await asyncio.sleep(0.01)
    assert await s.finish(TABLE[2:]) == 2
    assert pushes.calls == [([12, 13], [100, 101])]


async def test_a_preemption_or_a_changed_table_sends_everything_again():
    pushes = Pushes()
    s = stream(pushes)
    s.computed(TABLE[:2], 8)
    s.preempted()
    assert await s.finish(TABLE) == 0
    s = stream(Pushes())
    s.computed(TABLE[:2], 8)
    await asyncio.sleep(0)
    s.computed([20, 21, 22], 12)  # the pushed blocks are not the request's any more
    assert await s.finish([20, 21, 22, 23, 24, 25]) == 0


async def test_a_failed_push_stops_the_stream_and_the_hand_over_sends_all():
    pushes = Pushes()
    pushes.fail = True
    s = stream(pushes)
    s.computed(TABLE[:2], 8)
    await asyncio.sleep(0.01)  # the push failed
    s.computed(TABLE[:4], 16)  # nothing more after a failure
    await asyncio.sleep(0.01)
    assert await s.finish(TABLE) == 0
    assert len(pushes.calls) == 1


async def test_settle_waits_for_the_push_in_flight_and_starts_no_other():
    pushes = Pushes()
    pushes.gate.clear()
    s = stream(pushes)
    s.computed(TABLE[:1], 4)
    await asyncio.sleep(0)
    settled = asyncio.ensure_future(s.settle())
    await asyncio.sleep(0.01)
    assert not settled.done()  # the decode's blocks are still being written
    s.computed(TABLE[:4], 16)
    pushes.gate.set()
    await settled
    assert pushes.calls == [([10], [100])]


async def test_pushes_in_flight_are_bounded_by_the_slots():
    pushes = Pushes()
    pushes.gate.clear()
    slots = asyncio.Semaphore(1)
    a = KVStream("a", pushes, [1, 2], 0, BS, slots, asyncio.ensure_future)
    b = KVStream("b", pushes, [3, 4], 0, BS, slots, asyncio.ensure_future)
    a.computed([10, 11], 8)
    b.computed([20, 21], 8)
    await asyncio.sleep(0.01)
    assert len(pushes.calls) == 1  # b waits for a's slot
    pushes.gate.set()
    await asyncio.sleep(0.01)
    assert (await a.finish([10, 11]), await b.finish([20, 21])) == (2, 2)
    assert len(pushes.calls) == 2
