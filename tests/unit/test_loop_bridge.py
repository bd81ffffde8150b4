"""QueueSink: outputs emitted on another thread reach each request's queue in order, with
one event-loop wake-up per burst rather than one per output."""
from __future__ import annotations

import asyncio
import threading

from xllm_py.engine.async_engine import QueueSink
from xllm_py.outputs import (CompletionDelta, RequestOutput, TokenLogprob, copy_output,
                            merge_output)


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


def _step(i: int, finished: bool = False, reason: str | None = None) -> RequestOutput:
    return RequestOutput(request_id="r", num_generated_tokens=i + 1, finished=finished,
                         outputs=[CompletionDelta(index=0, text=f"t{i}", token_ids=[i],
                                                  logprobs=[TokenLogprob(i, -0.5)],
                                                  finish_reason=reason)])


async def test_final_only_sends_the_first_token_then_one_merged_output_at_the_end() -> None:
    sink = QueueSink(asyncio.get_running_loop(), final_only=True)
    steps = [_step(i) for i in range(4)] + [_step(4, finished=True, reason="length")]

    def engine_thread() -> None:
        for out in steps:
            sink.emit(out)

    t = threading.Thread(target=engine_thread)
    t.start()
    t.join()
    first = await asyncio.wait_for(sink.queue.get(), 5)
    last = await asyncio.wait_for(sink.queue.get(), 5)
    assert sink.queue.empty()
    assert first.outputs[0].token_ids == [0] and not first.finished
    d = last.outputs[0]
    assert last.finished and last.num_generated_tokens == 5
    assert d.token_ids == [1, 2, 3, 4] and d.text == "t1t2t3t4"
    assert [lp.token_id for lp in d.logprobs] == [1, 2, 3, 4]
    assert d.finish_reason == "length"
    # the engine's objects were not modified by the merge
    assert steps[1].outputs[0].token_ids == [1] and steps[1].outputs[0].text == "t1"


async def test_final_only_delivers_a_failure_with_what_was_held() -> None:
    sink = QueueSink(asyncio.get_running_loop(), final_only=True)
    sink.emit(_step(0))
    sink.emit(_step(1))
    sink.emit(RequestOutput(request_id="r", finished=True, error_code=500, error_message="boom"))
    await asyncio.wait_for(sink.queue.get(), 5)
    out = await asyncio.wait_for(sink.queue.get(), 5)
    assert out.failed and out.error_message == "boom" and out.outputs[0].token_ids == [1]


async def test_streaming_sink_delivers_every_output() -> None:
    sink = QueueSink(asyncio.get_running_loop())
    for i in range(3):
        sink.emit(_step(i, finished=i == 2))
    got = [await asyncio.wait_for(sink.queue.get(), 5) for _ in range(3)]
    assert [o.outputs[0].token_ids for o in got] == [[0], [1], [2]]


def test_merge_output_handles_new_choices_and_keeps_the_last_end_state() -> None:
    a = copy_output(RequestOutput(request_id="r", outputs=[CompletionDelta(index=0, text="a",
                                                                          token_ids=[1])]))
    b = RequestOutput(request_id="r", finished=True, num_cached_tokens=16, outputs=[
        CompletionDelta(index=1, text="x", token_ids=[7], finish_reason="stop", stop_reason="!"),
        CompletionDelta(index=0, text="b", token_ids=[2], finish_reason="length")])
    m = merge_output(a, b)
    assert m.finished and m.num_cached_tokens == 16
    assert [(d.index, d.text, d.token_ids, d.finish_reason) for d in m.outputs] == [
        (0, "ab", [1, 2], "length"), (1, "x", [7], "stop")]
    assert m.outputs[1].stop_reason == "!" and m.outputs[0].logprobs is None
