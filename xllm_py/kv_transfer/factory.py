"""create_backend: the enum factory for KV transfer backends (imports native libraries lazily)."""
from __future__ import annotations

import enum
import logging

from xllm_py.config import TransferConfig
from xllm_py.kv_transfer.base import KVTransferBackend
from xllm_py.kv_transfer.kv_storage import KVCacheStorage

logger = logging.getLogger(__name__)


class BackendKind(str, enum.Enum):
    UCX = "ucx"
    TCP = "tcp"
    FAKE = "fake"

    @classmethod
    def parse(cls, value: str) -> "BackendKind":
        try:
            return cls(value.lower())
        except ValueError:
            raise ValueError(f"unknown KV transfer backend {value!r}; expected one of {[k.value for k in cls]}") from None


def create_backend(name: str | BackendKind, storage: KVCacheStorage,
                   config: TransferConfig | None = None, **kwargs: object) -> KVTransferBackend:
    """Build (not start) a backend. ``kwargs`` go to the backend class (e.g. faults=, mode=)."""
    cfg = config or TransferConfig()
    kind = BackendKind.parse(name) if isinstance(name, str) else name
    if kind is BackendKind.FAKE:
        from xllm_py.kv_transfer.fake import FakeKVTransferBackend
        return FakeKVTransferBackend(storage, cfg.timeout_s, **kwargs)  # type: ignore[arg-type]
    if kind is BackendKind.TCP:
        from xllm_py.kv_transfer.tcp import TcpKVTransferBackend
        return TcpKVTransferBackend(storage, cfg.timeout_s, cfg.listen_host, cfg.listen_port, **kwargs)  # type: ignore[arg-type]
    from xllm_py.kv_transfer.ucx.backend import UcxKVTransferBackend
    return UcxKVTransferBackend(storage, cfg.timeout_s, cfg.listen_host, cfg.listen_port, **kwargs)  # type: ignore[arg-type]
