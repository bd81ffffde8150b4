"""PDConnector (engine/pd/connector.py): what the event loop posts reaches the engine
thread only through poll(), in order, and its answer comes back to the awaiting caller;
what the engine says (a first token, a failed request) runs on the event loop; a closed
loop never breaks the engine thread."""
from __future__ import annotations

import asyncio
import threading
import types

import pytest

from xllm_py.engine.kv_connector import AdmitRemote, Drop, KVConnector, RecvDone, SendDone
from xllm_py.engine.pd.connector import PDConnector


class _EngineThread:
    """Polls the connector on a thread of its own, as LLMEngine's loop does."""

    def __init__(self) -> None:
        self.woken = threading.Event()
        self.seen: list = []
        self.answer = lambda event: type(event).__name__
        self.thread: threading.Thread | None = None

    def serve(self, connector: PDConnector, n: int) -> None:
        def run() -> None:
            handled = 0
            while handled < n:
                self.woken.wait(5)
                self.woken.clear()
                for event, token in connector.poll():
                    self.seen.append((event, threading.current_thread().name))
                    try:
                        result = self.answer(event)
                    except Exception as exc:
                        result = exc
                    connector.resolve(token, result)
                    handled += 1
        self.thread = threading.Thread(target=run, name="engine")
        self.thread.start()


async def test_events_reach_the_engine_thread_in_order_and_answers_come_back():
    eng = _EngineThread()
    conn = PDConnector(asyncio.get_running_loop(), eng.woken.set, hands_over=False)
    eng.serve(conn, 3)
    req = types.SimpleNamespace(request_id="r1")
    assert await conn.admit_remote(req) == "AdmitRemote"
    await conn.recv_done("r1", [7], [None])
    await conn.drop("r2")
    eng.thread.join(5)
    assert [type(e) for e, _ in eng.seen] == [AdmitRemote, RecvDone, Drop]
    assert {name for _, name in eng.seen} == {"engine"}
    assert eng.seen[1][0] == RecvDone("r1", [7], [None])


async def test_an_engine_side_error_reaches_the_caller():
    eng = _EngineThread()
    eng.answer = lambda event: (_ for _ in ()).throw(ValueError("not SENDING_KV"))
    conn = PDConnector(asyncio.get_running_loop(), eng.woken.set, hands_over=True)
    eng.serve(conn, 1)
    with pytest.raises(ValueError, match="not SENDING_KV"):
        await conn.send_done("r1-0")
    eng.thread.join(5)
    assert isinstance(eng.seen[0][0], SendDone)


async def test_the_engines_word_runs_on_the_event_loop():
    loop = asyncio.get_running_loop()
    conn = PDConnector(loop, lambda: None, hands_over=True)
    got = []
    conn.on_first_token = lambda *args: got.append(("first", threading.current_thread().name,
                                                    args))
    conn.on_failed = lambda rid: got.append(("failed", threading.current_thread().name, rid))
    delta = types.SimpleNamespace(finish_reason=None, token_ids=[42], logprobs=[])
    upd = types.SimpleNamespace(request_id="r1-0", kv_held=True)

    def engine_side() -> None:
        conn.request_finished(upd, delta, [[1, 2]])
        conn.request_failed("r2")
    t = threading.Thread(target=engine_side, name="engine")
    t.start()
    t.join(5)
    for _ in range(10):
        await asyncio.sleep(0)
    main = threading.current_thread().name
    assert got == [("first", main, ("r1-0", [[1, 2]], 42, None, False, True)),
                   ("failed", main, "r2")]


def test_a_closed_loop_does_not_break_the_engine_thread():
    loop = asyncio.new_event_loop()
    conn = PDConnector(loop, lambda: None, hands_over=True)
    conn.on_failed = lambda rid: None
    fut = loop.create_future()
    loop.close()
    conn.resolve(fut, 1)  # (the node is stopping: nobody waits any more)
    conn.request_failed("r1")


def test_an_engine_without_remote_kv_has_nothing_to_poll():
    c = KVConnector()
    assert c.poll() == [] and not c.hands_over


async def test_a_step_reports_its_unfinished_prompt_chunks_and_preemptions_on_the_loop():
    from xllm_py.engine.scheduler_types import ScheduledSeq, SchedulerOutput

    loop = asyncio.get_running_loop()
    connector = PDConnector(loop, lambda: None, hands_over=True)
    seen: list = []
    done = asyncio.Event()
    connector.on_progress = lambda rid, table, n: seen.append(("chunk", rid, table, n))
    connector.on_preempted = lambda rid: seen.append(("preempted", rid))
    out = SchedulerOutput(seqs=[
        ScheduledSeq("a", [1] * 16, 32, [4, 5, 6], sample=False),  # a chunk of a prompt
        ScheduledSeq("b", [1] * 3, 10, [7, 8], sample=True),  # its last: request_finished
        ScheduledSeq("c", [1] * 8, 0, [9], sample=False, group_tables=[[1]]),  # hybrid
    ], preempted_ids=["d"])
    step = types.SimpleNamespace(out=out)
    t = threading.Thread(target=connector.on_step, args=(step,), name="engine")
    t.start()
    t.join()
    loop.call_soon(done.set)
    await done.wait()
    # (a hybrid model's: its group 0, the full-attention layers' table)
    assert seen == [("preempted", "d"), ("chunk", "a", [4, 5, 6], 48), ("chunk", "c", [9], 8)]
