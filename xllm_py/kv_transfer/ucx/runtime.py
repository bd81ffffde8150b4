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
        _load_cuda_bindings()
        ucxx.init(progress_mode=config.progress_mode, enable_python_future=config.python_future)
        atexit.register(_shutdown_ucx, ucxx)


def _load_cuda_bindings() -> None:
    """Do here, on the calling thread, what UCXX's progress thread does first when it starts:
    import ``cuda.core`` (0.3 s of extension loading) and look for a CUDA device. Left to that
    thread, the loading ran beside our own ``UCXWorker`` creation, and UCX patching the
    process's symbol tables while another thread dlopens a library crashed a process
    (SIGSEGV). Done once here, the progress thread finds the modules imported and the
    lookup answered in microseconds."""
    try:
        from ucxx._cuda_context import ensure_cuda_context

        ensure_cuda_context(0)
    except Exception as e:  # noqa: BLE001 - no CUDA here is the normal case on a CPU host
        logger.debug("ucx: no CUDA context (%s)", type(e).__name__)


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
