"""GGUF Q4_K and Q6_K linear weights kept quantized, as panels the native kernels read.

A GGUF Q4_K_M file stores some linear weights (gemma-3-270m: every attention output and MLP
down projection) in llama.cpp's K-quants, whose dequantized values are not a scale times an
int8 (Q4_K has an offset per 32 values), so int8 panels (int8_panels.py) cannot hold them
and they would stay float32 panels: 4 bytes a weight streamed per decode step. Here the
file's own blocks (``gguf_convert`` keeps them beside the HF directory, ``attach_blocks``
hands them to the linears at load) are re-laid out per 16 output rows:

- Q4_K: the 4-bit values as nibbles ``[np, K, 8]`` (byte i of row k: column i low, column
  i + 8 high), each 32-value sub-block's 6-bit scale and min ``[np, K/32, 16]`` uint8, each
  256-value super-block's float16 scale and min scale widened ``[np, K/256, 16]`` float32:
  0.59 bytes a weight (the file's: 0.5625);
- Q6_K: the 6-bit values less 32 as int8 ``[np, K, 16]``, the int8 scale of each 16
  ``[np, K/16, 16]``, the super-block scale ``[np, K/256, 16]`` float32: 1.08 bytes a weight.

``cpu_kernels.linear_panels_kquant`` widens them inside the matmul to exactly the float32
values the gguf package's ``dequantize`` gives (csrc/kquant.c says why they are exact) and
sums them as float32 panels would, bit for bit. The unpacking of the blocks mirrors the
gguf package's ``dequantize_blocks`` (and uses its Q4_K scale unpacking); the tests hold it
to ``gguf.quants.dequantize`` bit for bit, on the real file and on random blocks.
"""
from __future__ import annotations

import json
import logging
import pathlib
from dataclasses import dataclass

import numpy as np
import torch

from xllm_py.model import cpu_kernels
from xllm_py.model.gguf_convert import BLOCKS_FILE

logger = logging.getLogger(__name__)

QK_K = 256
# GGMLQuantizationType name -> (value, bytes per 256-value block)
TYPES = {"Q4_K": (12, 144), "Q6_K": (14, 210)}


@dataclass
class KQuantPanels:
    """One weight [N, K] as K-quant panels (module doc); ``mn``/``dm`` None for Q6_K."""

    qtype: str
    out_features: int
    in_features: int
    q: torch.Tensor
    sc: torch.Tensor
    mn: torch.Tensor | None
    d: torch.Tensor
    dm: torch.Tensor | None

    def __post_init__(self) -> None:
        # the kernels' arguments: type, then the arrays' addresses (they never move)
        self.args = (TYPES[self.qtype][0],) + tuple(
            None if t is None else t.data_ptr() for t in (self.q, self.sc, self.mn, self.d, self.dm))

    @property
    def num_panels(self) -> int:
        return self.q.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.q, self.sc, self.mn, self.d, self.dm) if t is not None)

    def dequantize(self) -> torch.Tensor:
        """The weight's float32 panels [np, K, 16] in torch (the kernels' fallback), the
        same values the kernels widen to: ``(d * sc) * q - dm * mn`` per column."""
        if self.qtype == "Q4_K":
            q = torch.cat([self.q & 0x0F, self.q >> 4], dim=-1).float()  # [np, K, 16]
            ds = self.d.repeat_interleave(8, dim=1) * self.sc.float()  # [np, K/32, 16]
            dm = self.dm.repeat_interleave(8, dim=1) * self.mn.float()
            return ds.repeat_interleave(32, dim=1) * q - dm.repeat_interleave(32, dim=1)
        ds = self.d.repeat_interleave(16, dim=1) * self.sc.float()  # [np, K/16, 16]
        return ds.repeat_interleave(16, dim=1) * self.q.float()

    def dequantize_native(self) -> torch.Tensor | None:
        """``dequantize`` by the kernels (what the matmul reads), or None without them."""
        return cpu_kernels.dequantize_kquant_panels(self)

    def weight(self, panels: torch.Tensor) -> torch.Tensor:
        """Float32 panels [np, K, 16] -> the weight [N, K]."""
        return panels.transpose(1, 2).reshape(-1, self.in_features)[:self.out_features]


def _f16(b: np.ndarray) -> np.ndarray:
    """[..., 2] uint8 -> [...] float32 (little-endian float16, widened)."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _panels(a: np.ndarray, dtype: np.dtype) -> torch.Tensor:
    """[N, X] -> [ceil(N/16), X, 16] (rows zero padded), as ``pack_panels`` lays rows out."""
    n, x = a.shape
    num = (n + 15) // 16
    out = np.zeros((num * 16, x), dtype=dtype)
    out[:n] = a
    return torch.from_numpy(np.ascontiguousarray(out.reshape(num, 16, x).transpose(0, 2, 1)))


def from_blocks(qtype: str, raw: np.ndarray, in_features: int) -> KQuantPanels:
    """Panels of a weight [N, in_features] from its GGUF blocks, uint8 [N, K/256 * bytes a
    block] (a row's blocks in order, as ``GGUFReader`` gives the tensor's data)."""
    if qtype not in TYPES:
        raise ValueError(f"not a K-quant type with panels: {qtype!r}")
    size = TYPES[qtype][1]
    n, k = raw.shape[0], in_features
    if k % QK_K or raw.shape[1] != k // QK_K * size:
        raise ValueError(f"{qtype} blocks of shape {list(raw.shape)} are not rows of {k} values")
    nb = k // QK_K
    b = raw.reshape(n, nb, size)
    if qtype == "Q4_K":
        from gguf.quants import Q4_K

        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])  # [N, nb]
        sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(b[..., 4:16]).reshape(n * nb, 12))
        qs = b[..., 16:].reshape(n, nb, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)
        q = (qs & np.uint8(0x0F)).reshape(n, k)  # value c*64 + t*32 + i: byte c*32 + i, nibble t
        qp = _panels(q, np.uint8)  # [np, K, 16]
        nib = (qp[..., :8] | (qp[..., 8:] << 4)).contiguous()
        return KQuantPanels(qtype, n, k, nib, _panels(sc.reshape(n, nb * 8), np.uint8),
                            _panels(mn.reshape(n, nb * 8), np.uint8), _panels(d, np.float32),
                            _panels(dmin, np.float32))
    ql = b[..., :128].reshape(n, nb, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)
    ql = (ql & np.uint8(0x0F)).reshape(n, nb, 256)
    qh = b[..., 128:192].reshape(n, nb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)
    qh = (qh & np.uint8(0x03)).reshape(n, nb, 256)
    q = ((ql | (qh << np.uint8(4))).astype(np.int8) - np.int8(32)).reshape(n, k)
    sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8).reshape(n, nb * 16)
    return KQuantPanels(qtype, n, k, _panels(q, np.int8), _panels(sc, np.int8), None,
                        _panels(_f16(b[..., 208:210]), np.float32), None)


def for_linear(linear: torch.nn.Module) -> KQuantPanels | None:
    """The K-quant panels of an ``nn.Linear`` the loader gave GGUF blocks
    (``gguf_blocks``: (type, uint8 rows)), when the kernels run here and the panels hold
    exactly its float32 weight; else None (it keeps its other panels)."""
    blocks = getattr(linear, "gguf_blocks", None)
    if blocks is None or not cpu_kernels.linear_available():
        return None
    qtype, raw = blocks
    weight = linear.weight.detach()
    try:
        kq = from_blocks(qtype, raw, weight.shape[1])
    except ValueError as e:
        logger.warning("GGUF blocks not used: %s", e)
        return None
    deq = kq.dequantize_native()
    if (kq.out_features != weight.shape[0] or deq is None
            or not torch.equal(kq.weight(deq), weight)):
        logger.warning("GGUF %s blocks of a [%d, %d] weight do not hold its values: float "
                       "panels kept", qtype, weight.shape[0], weight.shape[1])
        return None
    return kq


def attach_blocks(model: torch.nn.Module, model_dir: pathlib.Path,
                  targets: dict[str, tuple[str, int]]) -> int:
    """Give each ``nn.Linear`` whose weight the model dir's GGUF blocks file (written by
    gguf_convert) holds whole, in one type, its blocks as ``gguf_blocks``; returns how many.
    ``targets``: HF tensor name -> (our parameter name, first row). Fused weights (q/k/v,
    gate/up) qualify when all their parts have the same type."""
    path = model_dir / BLOCKS_FILE
    if not path.is_file():
        return 0
    from safetensors import safe_open

    parts: dict[str, list[tuple[int, str, np.ndarray]]] = {}
    with safe_open(str(path), framework="np") as f:
        types = json.loads((f.metadata() or {}).get("types", "{}"))
        for name in f.keys():
            if name in targets and types.get(name) in TYPES:
                param, row = targets[name]
                parts.setdefault(param, []).append((row, types[name], f.get_tensor(name)))
    count = 0
    for param, got in parts.items():
        if not param.endswith(".weight"):
            continue
        module = model.get_submodule(param[:-len(".weight")])
        got.sort(key=lambda p: p[0])
        starts = [0]
        for _, _, raw in got:
            starts.append(starts[-1] + raw.shape[0])
        if (not isinstance(module, torch.nn.Linear) or len({p[1] for p in got}) != 1
                or [p[0] for p in got] != starts[:-1] or starts[-1] != module.out_features):
            continue
        module.gguf_blocks = (got[0][1], np.concatenate([p[2] for p in got]))
        count += 1
    return count
