"""await_or_disconnect: a client hanging up cancels the awaited step and says so; a result
that is there already wins."""
from __future__ import annotations

import asyncio

import pytest

from xllm_py.api.generations import ClientDisconnected, await_or_disconnect


class _Request:
    """receive() answers http.disconnect once `gone` is set."""

    def __init__(self) -> None:
        self.gone = asyncio.Event()

    async def receive(self) -> dict:
        await self.gone.wait()
        return {"type": "http.disconnect"}


async def test_hangup_cancels_the_step_and_raises_client_disconnected():
    request, cleaned_up = _Request(), asyncio.Event()

    async def step() -> None:
        try:
            await asyncio.Event().wait()  # never answers
        finally:
            cleaned_up.set()

    waiting = asyncio.ensure_future(await_or_disconnect(request, step()))
    await asyncio.sleep(0)
    request.gone.set()
    # Before the fix: InvalidStateError "Result is not set." (task.result() on a task whose
    # cancellation had not run yet).
    with pytest.raises(ClientDisconnected):
        await asyncio.wait_for(waiting, 2)
    assert cleaned_up.is_set()


async def test_result_wins_and_errors_pass_through():
    request = _Request()
    assert await await_or_disconnect(request, asyncio.sleep(0, result=7)) == 7

    async def fail() -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        await await_or_disconnect(request, fail())
