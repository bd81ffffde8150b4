"""utils.aio.wait_for keeps a cancellation that races with its awaitable finishing, and a
stream pump told to stop stops even if its cancellation was lost."""
from __future__ import annotations

import asyncio
import sys

import pytest

from xllm_py.api.generations import Generations
from xllm_py.outputs import RequestOutput
from xllm_py.utils.aio import cancel_and_wait, wait_for


async def _cancel_as_item_arrives(waiter) -> tuple[asyncio.Task, list]:
    """A consumer loop over a queue; an item is put and the consumer cancelled in the same
    loop iteration. Returns the consumer task (given 0.3 s to end) and what it got."""
    q: asyncio.Queue = asyncio.Queue()
    got: list = []

    async def consume() -> None:
        while True:
            got.append(await waiter(q.get(), 10))

    task = asyncio.create_task(consume())
    await asyncio.sleep(0)  # the consumer is parked in q.get()
    q.put_nowait("item")
    task.cancel()
    await asyncio.wait({task}, timeout=0.3)
    return task, got


async def test_wait_for_keeps_a_cancel_that_races_with_a_result():
    task, got = await _cancel_as_item_arrives(wait_for)
    assert task.done() and task.cancelled()
    assert got == []


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="the stdlib race is fixed in 3.12")
async def test_the_race_is_real_with_asyncio_wait_for():
    # Documents why utils.aio exists: the same loop with the stdlib's wait_for keeps running.
    task, got = await _cancel_as_item_arrives(asyncio.wait_for)
    try:
        assert not task.done() and got == ["item"]
    finally:
        await cancel_and_wait(task)
    assert task.done()


async def test_wait_for_result_and_timeout():
    assert await wait_for(asyncio.sleep(0, result=7), 1.0) == 7
    assert await wait_for(asyncio.sleep(0, result=8), None) == 8
    with pytest.raises(asyncio.TimeoutError):
        await wait_for(asyncio.sleep(5), 0.01)
    fut = asyncio.get_running_loop().create_future()
    with pytest.raises(asyncio.TimeoutError):
        await wait_for(fut, 0.01)
    assert fut.cancelled()  # what timed out is cancelled, as with asyncio.wait_for


class _StubbornStream:
    """A backend stream that swallows cancellation (as a lost cancel would) and keeps
    producing outputs; records whether it was closed."""

    def __init__(self) -> None:
        self.produced = 0
        self.closed = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.produced >= 2000:  # bounded, so that a pump that never stops fails, not hangs
            raise StopAsyncIteration
        try:
            await asyncio.sleep(0.001)
        except asyncio.CancelledError:
            pass  # swallowed
        self.produced += 1
        return RequestOutput(request_id="r")

    async def aclose(self) -> None:
        self.closed = True


async def test_generations_pump_stops_after_cancel_even_if_the_cancel_is_lost():
    stream = _StubbornStream()
    gens = Generations([stream])
    assert await gens.next() is not None
    gens.cancel()
    await asyncio.wait(gens._tasks, timeout=1.0)
    assert all(t.done() for t in gens._tasks)
    assert stream.closed
    produced = stream.produced
    await asyncio.sleep(0.02)  # (a deliberate gap: a pump still running would produce in it)
    assert stream.produced == produced  # nothing pulls it any more
