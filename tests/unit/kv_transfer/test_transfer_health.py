"""TransferHealth (a transport broken for good turns /health unhealthy) and its wiring in
a backend and AsyncEngine.check_live."""
from __future__ import annotations

import types

from xllm_py.engine.async_engine import AsyncEngine
from xllm_py.kv_transfer.health import BROKEN_AFTER_S, BROKEN_MIN_FAILURES, TransferHealth


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_broken_takes_a_streak_of_failures_over_a_while():
    clock = Clock()
    h = TransferHealth(clock)
    for _ in range(BROKEN_MIN_FAILURES):
        h.failed("pull timed out")
    assert h.broken() is None  # a burst: not yet for good
    clock.t += BROKEN_AFTER_S
    why = h.broken()
    assert why.startswith(f"KV transfer broken: {BROKEN_MIN_FAILURES} transfers failed in a "
                          f"row over {BROKEN_AFTER_S:.0f}s") and "pull timed out" in why
    h.succeeded()  # one that works: healthy again
    assert h.broken() is None
    h.failed("x")
    clock.t += 10 * BROKEN_AFTER_S
    assert h.broken() is None  # one failure, however old, is not a streak
    assert "loop thread has stopped" in h.broken(loop_alive=False)


def test_a_backend_counts_its_transfers_and_health_reaches_check_live():
    from xllm_py.kv_transfer.base import TransferError, TransferTimeout
    from xllm_py.kv_transfer.fake import FakeKVTransferBackend

    backend = object.__new__(FakeKVTransferBackend)  # only the counting parts
    backend._stats = {"failures": 0}
    backend.name = "fake"
    clock = Clock()
    backend.health = TransferHealth(clock)
    for _ in range(BROKEN_MIN_FAILURES):
        backend._failed("pull", "10.0.0.1:1", 3, 1.0, TimeoutError())
        backend._failed("pull", "10.0.0.1:1", 3, 1.0,
                        TransferError("refused", invalid_argument=True))  # an answer
    clock.t += BROKEN_AFTER_S
    assert "timed out" in backend.health.broken()
    assert isinstance(backend._failed("pull", "p", 1, 1.0, TimeoutError()), TransferTimeout)

    from tests.unit.api.test_async_engine import stub_engine

    engine = stub_engine(num_waiting=0)
    engine._thread = types.SimpleNamespace(is_alive=lambda: True)
    api = AsyncEngine(engine)
    assert api.check_live() == (True, "ok")
    api.health_checks.append(backend.health.broken)
    live, why = api.check_live()
    assert not live and why.startswith("KV transfer broken")
