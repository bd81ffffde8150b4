"""KVCacheStorage: the paged KV cache of one worker, as one tensor.

Layout (docs/DESIGN.md): ``kv[2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]``
(index 0 = K, 1 = V). ``layer_caches()`` hands the model one (K, V) view per layer; the
transfer backends move whole blocks: for block ``b`` the ``2 * num_layers`` slices
``kv[:, :, b]``. A run of consecutive blocks ``kv[k, l, s:s+n]`` is contiguous in memory.
"""
from __future__ import annotations

import ctypes
import dataclasses
import logging
import mmap
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# Lists up to this long (block ids, runs) are checked / grouped with a loop over Python
# ints: fewer fixed costs than numpy calls (8 ids: ~3 vs ~14 us).
SMALL_LIST = 64

KV_LAYOUT = "kv,layer,block,slot,head,dim"

_DTYPES = ("float32", "float16", "bfloat16", "float64", "uint8", "int8")
# torch is imported where a pool is made or moved, not with this module: the simulated
# engine (xllm_py/sim) runs the transfer layer, which imports this module, without torch.


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported KV cache dtype {dtype!r}; expected one of {sorted(_DTYPES)}")
    return getattr(torch, dtype)


@dataclasses.dataclass(frozen=True)
class KVCacheMeta:
    """What a peer must agree on before blocks can be copied byte for byte."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    layout: str = KV_LAYOUT
    block_bytes: int = 0

    def block_shape_key(self) -> tuple:
        """Everything except num_blocks: two pools with equal keys exchange blocks."""
        return (self.num_layers, self.block_size, self.num_kv_heads, self.head_dim,
                self.dtype, self.layout, self.block_bytes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "KVCacheMeta":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


_HUGE_PAGE = 2 << 20
_PAGE = 4096
_MADV_POPULATE_WRITE = 23  # Linux 5.14+


def prefault_pages(address: int, nbytes: int) -> None:
    """Fill the page tables for ``[address, address + nbytes)`` writable, as touching every
    page would (a fresh mapping of a 256 MB pool otherwise costs its first uses ~65k page
    faults: a first pull at 1.1-1.7 instead of ~9 GB/s)."""
    start = address - address % _PAGE
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(start, address + nbytes - start, _MADV_POPULATE_WRITE) == 0:
        return
    view = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))  # older kernels
    view[::_PAGE] |= 0  # (a read-modify-write per page: faults it in writable, changes nothing)


def huge_page_allocator(nbytes: int) -> torch.Tensor:
    """``nbytes`` of zeroed host memory, 2 MB aligned and advised into transparent huge pages
    (where the kernel allows: madvise mode): the paged attention reads blocks scattered over
    the pool, with 4 KB pages a TLB miss every 4 KB; huge pages make those misses rare."""
    import torch

    m = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError) as e:  # (no THP support: plain pages)
        logger.debug("KV pool: no huge pages (%s)", e)
    raw = torch.frombuffer(m, dtype=torch.uint8)  # (the tensor keeps the mapping alive)
    off = -raw.data_ptr() % _HUGE_PAGE
    pool = raw[off:off + nbytes]
    prefault_pages(pool.data_ptr(), nbytes)  # now, as torch.zeros does, not in the first steps
    return pool


class KVCacheStorage:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "cpu",
        allocator: Callable[[int], torch.Tensor] | None = None,
    ) -> None:
        """``allocator(nbytes)``: where the pool lives instead of a fresh ``torch.zeros``, a
        zero-filled contiguous uint8 tensor of exactly ``nbytes`` on ``device`` (e.g. host
        memory UCX can let a peer map, ``factory.pool_allocator``)."""
        import torch

        for name, v in (("num_layers", num_layers), ("num_blocks", num_blocks),
                        ("block_size", block_size), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim)):
            if v <= 0:
                raise ValueError(f"{name} must be positive, got {v}")
        tdtype = parse_dtype(dtype)
        # kv: [2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]
        shape = (2, num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        if allocator is None:
            self.kv = torch.zeros(shape, dtype=tdtype, device=device)
        else:
            nbytes = 2 * num_layers * num_blocks * block_size * num_kv_heads * head_dim * tdtype.itemsize
            raw = allocator(nbytes)
            if (raw.dtype != torch.uint8 or raw.numel() != nbytes or not raw.is_contiguous()
                    or raw.device.type != torch.device(device).type):
                raise ValueError(f"allocator must return {nbytes} contiguous zeroed bytes (uint8)")
            self.kv = raw.view(tdtype).view(shape)
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = tdtype
        self.device = self.kv.device
        # Bytes of one (kv, layer, block) slice, and of one block across all layers and K/V.
        self.slice_bytes = block_size * num_kv_heads * head_dim * self.kv.element_size()
        self.block_bytes = 2 * num_layers * self.slice_bytes
        # Gather/scatter run on a wide-integer view [2 * num_layers, num_blocks, words]: torch's
        # index_select on CPU is far slower on float16 elements than on int64 words, and
        # moving blocks needs only their bytes.
        wide = torch.int64 if self.slice_bytes % 8 == 0 else torch.uint8
        self._wide = self.kv.view(torch.uint8).view(wide).view(2 * num_layers, num_blocks, -1)
        self.meta = KVCacheMeta(
            num_layers=num_layers, num_blocks=num_blocks, block_size=block_size,
            num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype_name(tdtype),
            layout=KV_LAYOUT, block_bytes=self.block_bytes,
        )

    @property
    def is_cuda(self) -> bool:
        return self.kv.is_cuda

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def layer_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One (K, V) view per layer, each [num_blocks, block_size, num_kv_heads, head_dim]."""
        return [(self.kv[0, i], self.kv[1, i]) for i in range(self.num_layers)]

    def check_block_ids(self, ids: Sequence[int] | np.ndarray, unique: bool = False) -> np.ndarray:
        """Validate block ids against this pool; returns them as an int64 array."""
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
        if 0 < arr.size <= SMALL_LIST:
            lst = arr.tolist()
            if min(lst) >= 0 and max(lst) < self.num_blocks and (not unique or len(set(lst)) == len(lst)):
                return arr
        if arr.size:  # (the reasons, or many ids)
            bad = arr[(arr < 0) | (arr >= self.num_blocks)]
            if bad.size:
                raise ValueError(
                    f"block ids out of range [0, {self.num_blocks}): {bad[:8].tolist()}"
                    + (f" (+{bad.size - 8} more)" if bad.size > 8 else "")
                )
            if unique and np.unique(arr).size != arr.size:
                raise ValueError("duplicate destination block ids")
        return arr

    def _index(self, ids: Sequence[int] | np.ndarray, unique: bool) -> torch.Tensor:
        import torch

        arr = self.check_block_ids(ids, unique=unique)
        return torch.from_numpy(arr).to(self.device)

    def blocks_shape(self, n: int) -> tuple[int, ...]:
        return (2, self.num_layers, n, self.block_size, self.num_kv_heads, self.head_dim)

    def read_blocks(self, ids: Sequence[int] | np.ndarray, out: torch.Tensor | None = None) -> torch.Tensor:
        """Gather whole blocks: a contiguous [2, num_layers, len(ids), block_size, heads, dim].

        ``out``: optional preallocated contiguous buffer (any dtype) of exactly
        ``len(ids) * block_bytes`` bytes on the cache's device, reused to avoid page faults.
        """
        import torch

        idx = self._index(ids, unique=False)
        n = idx.numel()
        if out is None:
            wide_out = self._wide.index_select(1, idx)
        else:
            wide_out = self._wide_view_of(out, n)
            torch.index_select(self._wide, 1, idx, out=wide_out)
        return wide_out.view(torch.uint8).view(self.dtype).view(self.blocks_shape(n))

    def write_blocks(self, ids: Sequence[int] | np.ndarray, buffer: torch.Tensor) -> None:
        """Scatter a buffer produced by ``read_blocks`` (same dtype, any shape of that numel),
        or raw bytes (a uint8 tensor of ``len(ids) * block_bytes``)."""
        import torch

        idx = self._index(ids, unique=True)
        n = idx.numel()
        if buffer.dtype != self.dtype and buffer.dtype != torch.uint8:
            raise ValueError(f"buffer dtype {buffer.dtype} != cache dtype {self.dtype}")
        if buffer.numel() * buffer.element_size() != n * self.block_bytes:
            raise ValueError(f"buffer has {buffer.numel()} elements, expected {n * self.block_bytes // self.kv.element_size()}")
        self._wide.index_copy_(1, idx, self._wide_view_of(buffer.to(self.device).contiguous(), n))

    def read_block_rows(self, ids: Sequence[int] | np.ndarray) -> torch.Tensor:
        """Copy blocks out one row each: a uint8 [len(ids), block_bytes], row i block ids[i]'s
        (K, V) x layer slices in order (the KV tiers store a block as one value)."""
        import torch

        idx = self._index(ids, unique=False)
        rows = self._wide.index_select(1, idx).transpose(0, 1).contiguous()
        return rows.view(torch.uint8).view(idx.numel(), -1)

    def write_block_rows(self, ids: Sequence[int] | np.ndarray, rows: torch.Tensor) -> None:
        """Write rows made by ``read_block_rows`` (uint8 [len(ids), block_bytes]) into blocks."""
        idx = self._index(ids, unique=True)
        n = idx.numel()
        if rows.numel() != n * self.block_bytes:
            raise ValueError(f"expected {n} rows of {self.block_bytes} bytes, got {rows.numel()} bytes")
        wide = rows.to(self.device).contiguous().view(-1).view(self._wide.dtype)
        self._wide.index_copy_(1, idx, wide.view(n, 2 * self.num_layers, -1).transpose(0, 1))

    def _wide_view_of(self, buf: torch.Tensor, n: int) -> torch.Tensor:
        import torch

        if not buf.is_contiguous() or buf.numel() * buf.element_size() != n * self.block_bytes:
            raise ValueError(f"buffer must be contiguous with {n * self.block_bytes} bytes")
        return buf.view(torch.uint8).reshape(-1).view(self._wide.dtype).view(2 * self.num_layers, n, -1)

    def byte_view(self) -> torch.Tensor:
        """The whole cache as uint8 (last dim scaled by the element size): buffer-protocol friendly."""
        import torch

        return self.kv.view(torch.uint8)


class StagingPool:
    """Reusable byte buffers for gather/scatter (fresh buffers cost page faults: ~3x a memcpy here).

    ``acquire(nbytes)`` returns a contiguous uint8 tensor of exactly ``nbytes`` (a view of a
    pooled buffer at least that large); ``release`` puts it back. Keeps at most ``max_buffers``.
    """

    def __init__(self, device: str | torch.device = "cpu", max_buffers: int = 4) -> None:
        import torch

        self.device = torch.device(device)
        self.max_buffers = max_buffers
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def acquire(self, nbytes: int) -> torch.Tensor:
        import torch

        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
            if fits:
                i = min(fits, key=lambda j: self._free[j].numel())
                return self._free.pop(i)[:nbytes]
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def release(self, view: torch.Tensor) -> None:
        base = view if view._base is None else view._base
        with self._lock:
            self._free.append(base)
            if len(self._free) > self.max_buffers:
                self._free.pop(min(range(len(self._free)), key=lambda j: self._free[j].numel()))
