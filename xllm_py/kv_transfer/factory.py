"""create_backend: the enum factory for KV transfer backends (imports native libraries lazily)."""
from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from xllm_py.config import EngineConfig, InstanceRole, TransferConfig, UCXConfig
from xllm_py.kv_transfer.base import KVTransferBackend
from xllm_py.kv_transfer.kv_storage import KVCacheStorage, huge_page_allocator

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


class BackendKind(str, enum.Enum):
    UCX = "ucx"
    TCP = "tcp"
    FAKE = "fake"
    SIM = "sim"  # the simulated engine's: a small payload per block, no torch (registered)

    @classmethod
    def parse(cls, value: str) -> "BackendKind":
        try:
            return cls(value.lower())
        except ValueError:
            raise ValueError(f"unknown KV transfer backend {value!r}; expected one of {[k.value for k in cls]}") from None


# Backends that live above this package register here: the simulator's (xllm_py/sim
# registers SIM when it is imported), which production code does not know.
_REGISTERED: dict[BackendKind, Callable[..., KVTransferBackend]] = {}


def register_backend(kind: BackendKind, backend_class: Callable[..., KVTransferBackend]) -> None:
    """``backend_class(storage, timeout_s, listen_host, listen_port, **kwargs)``, as TCP's."""
    _REGISTERED[kind] = backend_class


def create_backend(name: str | BackendKind, storage: KVCacheStorage,
                   config: TransferConfig | None = None, **kwargs: object) -> KVTransferBackend:
    """Build (not start) a backend. ``kwargs`` go to the backend class (e.g. faults=, mode=)."""
    cfg = config or TransferConfig()
    kind = BackendKind.parse(name) if isinstance(name, str) else name
    if kind is BackendKind.FAKE:
        from xllm_py.kv_transfer.fake import FakeKVTransferBackend
        return FakeKVTransferBackend(storage, cfg.timeout_s, **kwargs)  # type: ignore[arg-type]
    if kind is BackendKind.SIM:
        if kind not in _REGISTERED:
            raise ValueError("KV transfer backend 'sim' moves a simulated engine's pool: "
                             "import xllm_py.sim, which registers it")
        return _REGISTERED[kind](storage, cfg.timeout_s, cfg.listen_host, cfg.listen_port, **kwargs)
    if kind is BackendKind.TCP:
        from xllm_py.kv_transfer.tcp import TcpKVTransferBackend
        return TcpKVTransferBackend(storage, cfg.timeout_s, cfg.listen_host, cfg.listen_port, **kwargs)  # type: ignore[arg-type]
    from xllm_py.kv_transfer.ucx.backend import UcxKVTransferBackend
    return UcxKVTransferBackend(storage, cfg.timeout_s, cfg.listen_host, cfg.listen_port,  # type: ignore[arg-type]
                                config=cfg.ucx, **kwargs)


def pool_allocator(config: EngineConfig) -> Callable[[int], torch.Tensor] | None:
    """Where an engine's KV pool is allocated. PD roles with the UCX backend on host memory:
    memory a same-host peer can map (one memcpy per pull, ucx/shared_memory.py; without it,
    a plain torch tensor, whose page offset suits UCX's message path). Other host engines:
    huge pages (``kv_storage.huge_page_allocator``). GPU: a plain torch tensor (None)."""
    if config.device != "cpu":
        return None
    if (config.role in (InstanceRole.PREFILL, InstanceRole.DECODE)
            and BackendKind.parse(config.transfer.backend) is BackendKind.UCX):
        return mappable_host_allocator(config.transfer.ucx)
    return huge_page_allocator


def mappable_host_allocator(ucx: UCXConfig | None = None) -> Callable[[int], torch.Tensor] | None:
    """An allocator of host memory that UCX peers on this host can map, or None when the
    UCX backend is not installed or mapping is off (``XLLM_UCX_MAP=0``; ``ucx`` None: the
    settings from the environment)."""
    try:
        from xllm_py.kv_transfer.ucx import shared_memory
        from xllm_py.kv_transfer.ucx.env import import_ucxx, iov_worker_config

        import_ucxx()
    except ImportError:
        return None
    ucx = ucx if ucx is not None else UCXConfig.from_env()
    if not shared_memory.mapping_enabled(ucx):
        return None

    def allocate(nbytes: int) -> torch.Tensor:
        import torch

        try:
            return shared_memory.allocate(nbytes, iov_worker_config(ucx))
        except Exception as e:  # noqa: BLE001 - fall back to private memory (the iov path)
            logger.warning("KV pool: UCX could not allocate %d mappable bytes (%s); using private memory",
                           nbytes, e)
            return torch.zeros(nbytes, dtype=torch.uint8)

    return allocate
