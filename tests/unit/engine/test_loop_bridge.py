"""QueueSink: outputs emitted on another thread reach each request's queue in order, with
one event-loop wake-up per burst rather than one per output."""
from __future__ import annotations

import asyncio
import threading

from xllm_py.engine.async_engine import QueueSink
from xllm_py.outputs import RequestOutput


async def test_burst_is_delivered_in_order_with_coalesced_wakeups() -> None:
    loop = asyncio.get_running_loop()
    wakeups = 0
    real = loop.call_soon_threadsafe

    def counting(cb, *args):
        nonlocal wakeups
        wakeups += 1
        return real(cb, *args)

    loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
    try:
        sinks = [QueueSink(loop) for _ in range(3)]
        steps = 50

        def engine_thread() -> None:
            for step in range(steps):  # one "engine step": an output per request
                for i, sink in enumerate(sinks):
                    sink.emit(RequestOutput(request_id=f"r{i}", num_generated_tokens=step,
                                            finished=step == steps - 1))

        t = threading.Thread(target=engine_thread)
        t.start()
        t.join()  # blocks the loop: the whole burst is emitted before it can drain
        for i, sink in enumerate(sinks):
            got = [await asyncio.wait_for(sink.queue.get(), 5) for _ in range(steps)]
            assert [o.num_generated_tokens for o in got] == list(range(steps))
            assert all(o.request_id == f"r{i}" for o in got) and got[-1].finished
        assert wakeups == 1  # 150 outputs, one wake-up
    finally:
        loop.call_soon_threadsafe = real  # type: ignore[method-assign]
