"""Building an engine's KV tiers from its configuration: the keyspace (what makes its KV
bytes what they are), the tiers' sizes from the machine where not given, the store's
client. None where the engine runs without tiers (prefix caching off, a simulated engine,
TP > 1: each rank would have to move its own head slice, which the tiers do not do yet).
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import pathlib
from typing import TYPE_CHECKING, Callable

from xllm_py.config import EngineConfig, advertised_host, kv_tier_dir_from_env
from xllm_py.kv_tiers.disk import DiskTier
from xllm_py.kv_tiers.host import HostTier
from xllm_py.kv_tiers.keys import TierKeyspace
from xllm_py.kv_tiers.stack import TierStack
from xllm_py.kv_tiers.store import MooncakeStore

if TYPE_CHECKING:
    from xllm_py.engine.kv_cache_manager import KVCacheManager
    from xllm_py.engine.kv_tiering import KVTiering
    from xllm_py.kv_transfer.kv_storage import KVCacheStorage

logger = logging.getLogger(__name__)

MB = 1 << 20
HOST_SHARE, HOST_MAX = 8, 8192 * MB  # of the memory available at start
DISK_SHARE, DISK_MAX = 4, 16384 * MB  # of the free space in the directory
DEFAULT_DISK_DIR = os.path.join("~", ".cache", "xllm_py", "kv_tiers")
_MODEL_CODE = pathlib.Path(__file__).resolve().parents[1] / "model"


@functools.lru_cache(maxsize=1)
def kv_code_fingerprint() -> str:
    """A hash of the code that computes KV (the model and its kernels): blocks written by
    another version of it are never read (their floats may differ in the last bits)."""
    h = hashlib.sha256()
    for path in sorted(_MODEL_CODE.rglob("*")):
        if path.suffix in (".py", ".c", ".h"):
            h.update(path.name.encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def checkpoint_fingerprint(model_dir: str) -> str:
    """The checkpoint's identity: its config and its weight files' names and sizes."""
    h = hashlib.sha256()
    root = pathlib.Path(model_dir)
    for path in sorted(root.iterdir()) if root.is_dir() else [root]:
        if path.name == "config.json":
            h.update(path.read_bytes())
        elif path.suffix in (".safetensors", ".gguf", ".bin", ".pt"):
            h.update(f"{path.name}:{path.stat().st_size}".encode())
    return h.hexdigest()[:16]


def available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def build_tiering(config: EngineConfig, model_dir: str, storage: KVCacheStorage,
                  kv: KVCacheManager, wake: Callable[[], None]) -> KVTiering | None:
    from xllm_py.engine.kv_tiering import KVTiering

    tc = config.tiers
    if not config.cache.enable_prefix_caching or config.simulate:
        return None  # (a simulated pool holds a token of payload per block, not KV)
    if config.tensor_parallel_size > 1 or config.pipeline_parallel_size > 1:
        # (rank 0's pool holds its heads or its stage's layers only)
        logger.info("KV tiers off: not at tensor or pipeline parallelism > 1 yet")
        return None
    keyspace = TierKeyspace(
        model=f"{os.path.basename(os.path.normpath(model_dir))}:{checkpoint_fingerprint(model_dir)}"
              f":{config.weight_dtype}:{kv_code_fingerprint()}",
        kv_dtype=storage.meta.dtype, block_size=storage.block_size, layout=storage.meta.layout,
        num_slots=storage.num_layers, num_kv_heads=storage.num_kv_heads,
        head_dim=storage.head_dim, group_windows=tuple(kv.group_windows),
        block_bytes=storage.block_bytes)
    host_bytes = tc.host_bytes if tc.host_bytes is not None else min(
        HOST_MAX, available_memory_bytes() // HOST_SHARE)
    host = HostTier(host_bytes) if host_bytes > 0 else None
    disk = _disk_tier(tc.disk_dir, tc.disk_bytes, keyspace.namespace)
    store = _store(config, keyspace)
    if host is None and disk is None and store is None:
        return None
    logger.info("KV tiers: host %s, disk %s, store %s",
                "off" if host is None else f"{host.capacity_bytes // MB} MB",
                "off" if disk is None else f"{disk.capacity_bytes // MB} MB in {disk.root}",
                "off" if store is None else store.master)
    return KVTiering(TierStack(host, disk, store), keyspace, storage, kv, wake)


def _disk_tier(root: str | None, capacity: int | None, namespace: str) -> DiskTier | None:
    if capacity == 0:
        return None
    root = (root or kv_tier_dir_from_env() or DEFAULT_DISK_DIR).replace("{pid}", str(os.getpid()))
    path = os.path.join(os.path.expanduser(root), namespace)
    try:
        os.makedirs(path, exist_ok=True)
        if capacity is None:
            st = os.statvfs(path)
            capacity = min(DISK_MAX, st.f_bavail * st.f_frsize // DISK_SHARE)
        return DiskTier(path, capacity) if capacity > 0 else None
    except OSError as e:
        logger.warning("KV disk tier off: %s cannot be used (%s)", path, e.strerror or e)
        return None


def _store(config: EngineConfig, keyspace: TierKeyspace) -> MooncakeStore | None:
    tc = config.tiers
    if not tc.store:
        return None
    metadata = tc.store_metadata
    if metadata is None:
        if not config.etcd_addr or config.security.etcd_tls is not None:
            logger.warning("KV store off: set kv_store_metadata (--config FILE: etcd://HOST:PORT or an "
                           "HTTP metadata URL); %s", "the cluster's etcd uses TLS"
                           if config.etcd_addr else "this engine has no etcd")
            return None
        # The store takes one etcd: the first member of a cluster (a cache: a miss while it is down)
        metadata = f"etcd://{config.etcd_addr.split(',')[0]}"
    store = MooncakeStore(tc.store, metadata, advertised_host(config.host, config.advertise_host),
                          segment_bytes=tc.store_segment_bytes, timeout_s=tc.store_timeout_s)
    return store if store.connect() else None
