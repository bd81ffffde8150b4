"""Backend streams of one HTTP request, and the race against the client going away.

`Generations` drains one backend stream per prompt (each in its own pump task) into one
queue, so the choices of all prompts interleave; `await_or_disconnect` awaits a step of
the response unless the client disconnects first. Cancelling the pumps closes the backend
streams (`aclose()`), which is how a backend learns to abort a request.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from starlette.requests import Request

from xllm_py.api.backend import GenerateBackend, GenerateRequest
from xllm_py.api.errors import APIError, BackendError
from xllm_py.outputs import RequestOutput

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was complete."""


class Generations:
    """Drains one backend stream per prompt (each in its own task) into a single queue."""

    _END = object()

    def __init__(self, streams: list[AsyncIterator[RequestOutput]],
                 on_cancel: Callable[[], None] | None = None) -> None:
        self._queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self._num_open = len(streams)
        self._cancelled = False
        self._on_cancel = on_cancel  # run once, at the first cancel() (admission ticket)
        self._tasks = [
            asyncio.ensure_future(self._pump(i, s)) for i, s in enumerate(streams)
        ]

    async def _pump(self, prompt_index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                self._queue.put_nowait((prompt_index, out))
                if out.finished or out.failed or self._cancelled:
                    break
        except asyncio.CancelledError:
            raise
        except Exception as e:  # reported to the consumer, which answers the client
            if not isinstance(e, APIError):
                logger.exception("backend stream of prompt %d failed", prompt_index)
            self._queue.put_nowait((prompt_index, e))
        finally:
            await aclose_stream(stream)
            self._queue.put_nowait((prompt_index, self._END))

    async def next(self) -> tuple[int, RequestOutput] | None:
        """The next (prompt_index, output); None when every stream has ended."""
        while self._num_open > 0:
            prompt_index, item = await self._queue.get()
            if item is self._END:
                self._num_open -= 1
                continue
            if isinstance(item, APIError):
                raise item
            if isinstance(item, Exception):
                raise BackendError(f"backend failure ({type(item).__name__})") from item
            return prompt_index, item
        return None

    def cancel(self) -> None:
        """Cancel every pump; each closes its backend stream (synchronous, safe to call twice).
        A pump whose cancellation is lost stops at its next output all the same."""
        self._cancelled = True
        for t in self._tasks:
            t.cancel()
        on_cancel, self._on_cancel = self._on_cancel, None
        if on_cancel is not None:
            on_cancel()

    async def aclose(self) -> None:
        self.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def start_streams(backend: GenerateBackend, reqs: list[GenerateRequest]) -> list[AsyncIterator[RequestOutput]]:
    """One backend stream per request; if starting one raises, the streams already made are
    closed (never started: without awaiting) and the error is re-raised."""
    streams: list[AsyncIterator[RequestOutput]] = []
    try:
        for r in reqs:
            streams.append(backend.generate(r))
    except BaseException:
        for s in streams:
            if getattr(s, "aclose", None) is not None:
                asyncio.ensure_future(aclose_stream(s))
        raise
    return streams


async def aclose_stream(stream: Any) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is None:
        return
    try:
        await aclose()
    except Exception:
        logger.warning("closing a backend stream failed", exc_info=True)


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def await_or_disconnect(request: Request, aw: Awaitable[_T]) -> _T:
    """Await `aw`; if the client disconnects first, cancel it, let the cancellation run and
    raise ClientDisconnected. A result that is already there when the client goes wins."""
    task = asyncio.ensure_future(aw)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.done() and not task.cancelled():
        return task.result()
    # Cancelled just now: the task has not run its cancellation yet, so it has no result
    # (asking for one raised InvalidStateError "Result is not set."). Let it finish.
    await asyncio.gather(task, return_exceptions=True)
    raise ClientDisconnected()
