"""KVCacheStorage: the paged KV cache of one worker, as one tensor.

Layout (docs/DESIGN.md): ``kv[2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]``
(index 0 = K, 1 = V). ``layer_caches()`` hands the model one (K, V) view per layer; the
transfer backends move whole blocks: for block ``b`` the ``2 * num_layers`` slices
``kv[:, :, b]``. A run of consecutive blocks ``kv[k, l, s:s+n]`` is contiguous in memory.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import numpy as np
import torch

logger = logging.getLogger(__name__)

KV_LAYOUT = "kv,layer,block,slot,head,dim"

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "uint8": torch.uint8,
    "int8": torch.int8,
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unsupported KV cache dtype {dtype!r}; expected one of {sorted(_DTYPES)}") from None


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
    ) -> None:
        for name, v in (("num_layers", num_layers), ("num_blocks", num_blocks),
                        ("block_size", block_size), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim)):
            if v <= 0:
                raise ValueError(f"{name} must be positive, got {v}")
        tdtype = parse_dtype(dtype)
        # kv: [2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]
        self.kv = torch.zeros(
            (2, num_layers, num_blocks, block_size, num_kv_heads, head_dim),
            dtype=tdtype, device=device,
        )
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
        if arr.size:
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
        arr = self.check_block_ids(ids, unique=unique)
        return torch.from_numpy(arr).to(self.device)

    def read_blocks(self, ids: Sequence[int] | np.ndarray) -> torch.Tensor:
        """Gather whole blocks: a contiguous [2, num_layers, len(ids), block_size, heads, dim]."""
        return self.kv.index_select(2, self._index(ids, unique=False))

    def write_blocks(self, ids: Sequence[int] | np.ndarray, buffer: torch.Tensor) -> None:
        """Scatter a buffer produced by ``read_blocks`` (same dtype, any shape of that numel)."""
        idx = self._index(ids, unique=True)
        shape = (2, self.num_layers, idx.numel(), self.block_size, self.num_kv_heads, self.head_dim)
        if buffer.dtype != self.dtype:
            raise ValueError(f"buffer dtype {buffer.dtype} != cache dtype {self.dtype}")
        if buffer.numel() != int(np.prod(shape)):
            raise ValueError(f"buffer has {buffer.numel()} elements, expected {int(np.prod(shape))}")
        self.kv.index_copy_(2, idx, buffer.reshape(shape).to(self.device))

    def block_run(self, kv: int, layer: int, start: int, length: int) -> torch.Tensor:
        """The contiguous slice kv[kv, layer, start:start+length] (no bounds check here)."""
        return self.kv[kv, layer, start:start + length]

    def byte_view(self) -> torch.Tensor:
        """The whole cache as uint8 (last dim scaled by the element size): buffer-protocol friendly."""
        return self.kv.view(torch.uint8)
