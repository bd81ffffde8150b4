"""Server-sent events: encoding and a streaming response that notices client disconnects.

`SSEResponse` runs the body and a disconnect listener side by side whatever the ASGI spec
version, and always closes the body iterator at the end, so that a client going away
closes the generation promptly (Starlette's StreamingResponse relies on a failed send under
ASGI 2.4, which never happens while the backend is silent).
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

logger = logging.getLogger(__name__)

DONE_EVENT = "data: [DONE]\n\n"


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def sse_event(obj: Any) -> str:
    return f"data: {dumps(obj)}\n\n"


class SSEResponse(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(self, content: Any, *, on_close: Any = None, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.on_close = on_close  # run at the end even if the body never started

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.ensure_future(self.stream_response(send))
        watcher = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            done, _ = await asyncio.wait({stream, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if stream in done:
                exc = stream.exception()
                if exc is not None and not isinstance(exc, OSError):
                    raise exc
            else:
                logger.debug("client disconnected mid-stream")
        finally:
            stream.cancel()
            watcher.cancel()
            await asyncio.gather(stream, watcher, return_exceptions=True)
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
            if self.on_close is not None:
                self.on_close()
