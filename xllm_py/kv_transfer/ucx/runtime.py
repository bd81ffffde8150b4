"""The process's UCXX: initialised once, one event loop for every backend, stopped at exit.

UCXX needs one asyncio loop per process for all its calls (its notifier thread completes
futures there): every UCX backend of a process shares ``shared_loop()``.
"""
from __future__ import annotations

import atexit
import logging
import threading
from typing import Any

from xllm_py.config import UCXConfig
from xllm_py.kv_transfer.base import LoopThread

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_loop: LoopThread | None = None


def shared_loop() -> LoopThread:
    global _loop
    with _lock:
        if _loop is None:
            _loop = LoopThread("kv-ucx")
        return _loop


def init_ucxx(ucxx: Any, config: UCXConfig) -> None:
    """``ucxx.init`` unless this process did it already (on the shared loop's thread)."""
    if ucxx.core._ctx is None:
        ucxx.init(progress_mode=config.progress_mode, enable_python_future=config.python_future)
        atexit.register(_shutdown_ucx, ucxx)


def _shutdown_ucx(ucxx: Any) -> None:
    """Stop UCXX's notifier and progress threads before the interpreter exits (else: std::terminate)."""
    ctx = ucxx.core._ctx
    if ctx is None:
        return
    try:
        ctx.stop_notifier_thread()
        if ctx.progress_mode.startswith("thread"):
            ctx.worker.stop_progress_thread()
    except Exception as e:  # noqa: BLE001
        logger.warning("ucx: stopping UCXX threads at exit failed: %s", e)
