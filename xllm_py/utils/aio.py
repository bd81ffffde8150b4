"""asyncio helpers that keep a task's cancellation.

Python 3.11's `asyncio.wait_for` runs its awaitable as an inner task; when the outer task
is cancelled in the same loop iteration as the inner one finishes, it returns the result
and the cancellation is lost (CPython gh-86296, fixed in 3.12). A consumer loop that was
told to stop then keeps going: a client's dropped stream kept its engine request running
to max_tokens. `wait_for` here awaits in the caller's own task under `asyncio.timeout`,
so a cancel is never swallowed.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, TypeVar

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


async def wait_for(aw: Awaitable[_T], timeout: float | None) -> _T:
    """`asyncio.wait_for` without the lost-cancellation race; raises asyncio.TimeoutError."""
    async with asyncio.timeout(timeout):
        return await aw


async def cancel_and_wait(task: "asyncio.Task[object] | None") -> None:
    """Cancel `task` and wait for it to end (re-cancelling, in case something inside it
    still swallows a cancellation)."""
    if task is None:
        return
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=0.5)
    if not task.cancelled() and task.exception() is not None:
        logger.debug("task %s ended with %r", task.get_name(), task.exception())
