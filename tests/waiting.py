"""Wait for a condition with a deadline (never a fixed sleep followed by an assert)."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def wait_until(pred: Callable[[], object], timeout_s: float, step_s: float = 0.02) -> float:
    """Seconds until pred() is true; fails the test on timeout."""
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"condition not met within {timeout_s}s")
        await asyncio.sleep(step_s)
    return time.monotonic() - t0


def wait_until_sync(pred: Callable[[], object], timeout_s: float, step_s: float = 0.02) -> float:
    """wait_until for plain threads (blocks the caller)."""
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"condition not met within {timeout_s}s")
        time.sleep(step_s)
    return time.monotonic() - t0
