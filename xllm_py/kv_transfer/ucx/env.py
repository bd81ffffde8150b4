"""UCX settings for KV transfer, in one place, applied before ucxx is imported.

Why these settings: an endpoint made from the peer's worker address without error
handling may use shared memory (sysv, cma), which a sockaddr endpoint with peer error
handling may not (it falls back to tcp over loopback); the rendezvous protocol reads the
sender's buffer (``UCX_RNDV_SCHEME=get_zcopy``), the fastest of the schemes for large
messages; python futures are completed by ucxx's notifier thread, where a yield-polling
loop would take the CPU the copy needs. Host memory goes through a UCP context of its own
(``UCX_IOV_DEFAULTS`` below, ``iov_worker.py``): one iov tag message per pull. Figures:
docs/benchmarks.md (``bench_kv_transfer.py``).

For the tag path (CUDA memory, modes direct/gather) the backend uses two endpoints per peer: a sockaddr control endpoint with error
handling (tcp; detects a dead peer) and a data endpoint created from the peer's worker
address without error handling, which lets UCX use shared memory (cma zero-copy get).
Any variable already set in the environment wins (``config.apply_env_defaults``; the
environment itself is read and written in xllm_py/config.py only).
"""
from __future__ import annotations

import logging
from types import ModuleType

from xllm_py.config import UCXConfig, apply_env_defaults, env_with_prefix

logger = logging.getLogger(__name__)

UCX_ENV_DEFAULTS_CPU: dict[str, str] = {
    # shared memory (cma/posix/sysv) for data, tcp for the listener (connection manager), self for loopback.
    "UCX_TLS": "sm,self,tcp",
    # Large messages: rendezvous, the receiver reads the sender's pages (cma process_vm_readv): zero-copy.
    "UCX_RNDV_SCHEME": "get_zcopy",
    # ucxx sets "cuda" when unset; host memory fragments on CPU-only machines.
    "UCX_RNDV_FRAG_MEM_TYPE": "host",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
    # Futures completed by ucxx's notifier thread: no busy-yield polling on the event loop.
    "UCXPY_ENABLE_PYTHON_FUTURE": "1",
    "UCXPY_PROGRESS_MODE": "thread",
}

UCX_ENV_DEFAULTS_GPU: dict[str, str] = {
    "UCX_TLS": "sm,self,tcp,cuda_copy,cuda_ipc",
    "UCX_RNDV_SCHEME": "get_zcopy",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
    "UCXPY_ENABLE_PYTHON_FUTURE": "1",
    "UCXPY_PROGRESS_MODE": "thread",
}


# The host-memory data path (iov_worker.py) runs its own UCP context with these settings
# (UCX config names without the UCX_ prefix). Override one with XLLM_UCX_IOV_<NAME>=value
# (UCXConfig.iov_overrides).
UCX_IOV_DEFAULTS: dict[str, str] = {
    # Same-host peers only (shared memory; cma for rendezvous reads). With tcp in the list
    # every rendezvous send pays for the tcp transport's wire-up too.
    # A peer this context cannot reach (another host) falls back to the ucxx tag path.
    "TLS": "sm,self",
}


def iov_worker_config(config: UCXConfig | None = None) -> dict[str, str]:
    """The iov context's UCX settings: the defaults, then ``config``'s overrides (None: from the environment)."""
    cfg = config if config is not None else UCXConfig.from_env()
    return {**UCX_IOV_DEFAULTS, **dict(cfg.iov_overrides)}


def apply_ucx_env_defaults(gpu: bool = False) -> dict[str, str]:
    """Set the defaults that are not already set; returns the effective UCX/UCXPY settings."""
    apply_env_defaults(UCX_ENV_DEFAULTS_GPU if gpu else UCX_ENV_DEFAULTS_CPU)
    return ucx_env()


def ucx_env() -> dict[str, str]:
    return env_with_prefix("UCX_", "UCXPY_", "XLLM_UCX_")


def import_ucxx(gpu: bool = False) -> ModuleType:
    """Import ucxx after applying the defaults, with an actionable error when missing.

    UCX reads its settings once per process: a process that used ucxx for host memory
    first cannot move CUDA memory later unless its UCX_TLS already named cuda_copy."""
    import sys

    if gpu and "ucxx" in sys.modules:
        tls = ucx_env().get("UCX_TLS", "all")
        if tls != "all" and "cuda" not in tls:
            raise RuntimeError(
                f"ucxx was set up for host memory in this process (UCX_TLS={tls}); a CUDA KV "
                f"pool needs {UCX_ENV_DEFAULTS_GPU['UCX_TLS']!r} in UCX_TLS before ucxx's "
                "first use")
    apply_ucx_env_defaults(gpu)
    try:
        import ucxx
    except ImportError as e:
        raise ImportError(
            "the 'ucx' KV transfer backend needs UCXX: pip install ucxx-cu12 "
            "(or pip install 'xllm-py[ucx]'), or choose --kv-transfer-backend tcp. "
            f"Import failed with: {e}"
        ) from e
    return ucxx
