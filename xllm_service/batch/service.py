"""BatchService: the Batch API on one service process: its routes on the OpenAI app, and
the runner task (which runs batches only while this service is the master)."""
from __future__ import annotations

import asyncio
import logging
import pathlib
from typing import Callable, Sequence

from xllm_service.batch.api import install_batch_api
from xllm_service.batch.files import FileStore
from xllm_service.batch.runner import BatchRunner, asgi_executor
from xllm_service.batch.store import BatchStore

logger = logging.getLogger(__name__)


class BatchService:
    def __init__(self, app, root: str, api_keys: Sequence[str],
                 is_master: Callable[[], bool]) -> None:
        path = pathlib.Path(root)
        self.files = FileStore(path)
        self.store = BatchStore(path)
        install_batch_api(app, self.files, self.store)
        execute, self._close = asgi_executor(app, api_keys[0] if api_keys else None)
        self.runner = BatchRunner(self.store, self.files, execute, is_master)
        self._task: asyncio.Task | None = None
        logger.info("Batch API on, files and batches in %s", path)

    def start(self) -> None:
        self._task = asyncio.create_task(self.runner.loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.runner.stop()
        await self._close()
