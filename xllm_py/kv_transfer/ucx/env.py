"""UCX settings for KV transfer, in one place, applied before ucxx is imported.

Measured on the 2-core development VM (64 MB tag message between two processes,
ucxx 0.52 / UCX 1.21, python futures on):

===========================================  ===========
settings                                     GB/s (best)
===========================================  ===========
ucxx defaults (sockaddr endpoint, tcp/lo)    0.5 - 0.6
UCX_TLS=sm,self,tcp (sockaddr ep + err. h.)  0.6  (sm is excluded by peer error handling)
worker-address ep, no err. handling          1.3  (sysv + cma, rndv default)
  + UCX_RNDV_SCHEME=put_zcopy                1.9
  + UCX_RNDV_SCHEME=get_zcopy                4.0 - 4.8  (numpy memcpy: ~4.8)
same, without python futures                 1.3 - 2.5  (yield-polling loop steals the CPU)
===========================================  ===========

Host memory now goes through a UCP context of its own (``UCX_IOV_DEFAULTS`` below,
``iov_worker.py``): one iov tag message per pull, 2-core VM, bench_kv_transfer.py:
256 MB contiguous 4.7 - 6.2 GB/s (53 - 66% of memcpy), fragmented 4.1 - 4.7 GB/s;
ucx_perftest tag_bw here: 32 MB sm (cma get) 3.3 - 3.5 GB/s, posix 6.1 - 6.4 GB/s,
2048 x 16 KiB iov 4.3 - 5.5 GB/s.

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
    # every rendezvous send costs ~90 us more here (ucx_perftest-style loop, 1 MB: 120 vs 30 us).
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
