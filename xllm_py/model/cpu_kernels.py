"""Native CPU kernels (``csrc/*.c``), compiled on first use and called through ctypes.

Why: decode attention over the paged cache in torch needs a gather of every sequence's
blocks into a new tensor and a masked SDPA per layer; at 32 sequences that is two thirds
of a forward. The C kernel reads the blocks in place (online softmax per block), with no
gather and no mask (figures: docs/benchmarks.md).

The sources are plain C + OpenMP (no Python or torch headers): ``cc`` builds them
(kernel_build.py: for the widest instruction set the CPU has) in under a second into
``$XLLM_KERNEL_CACHE`` (default ``~/.cache/xllm_py/kernels``; ``config.KernelConfig``
reads the variables), one file per source/flags hash, written atomically so concurrent
processes can race safely.
The library links to the OpenMP runtime torch has loaded, so it shares torch's threads.

Everything degrades: no compiler, a failed build, ``XLLM_CPU_KERNELS=0`` or an
unsupported shape/dtype, and callers take the torch path (``available()`` is False or
the call returns None). Tests run both paths against each other.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import pathlib
import threading
from typing import TYPE_CHECKING, Iterator

import torch

from xllm_py.config import KernelConfig
from xllm_py.model import kernel_build

if TYPE_CHECKING:
    import numpy as np

    from xllm_py.model.kquant_panels import KQuantPanels

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_lib_isa = ""  # what _lib was built for
_tried = False
_why_not = ""
_off = False  # set by disabled() (tests of the torch path)

MAX_GROUP = 16  # query heads per KV head (csrc XLLM_MAX_GROUP)
MAX_HEAD_DIM = 256
MAX_BLOCK_SIZE = 256
# linear_panels handles up to this many rows (decode batches: there it is faster than
# oneDNN's packed matmul, past it no longer), linear_large more, on the same panels, at
# least as fast as oneDNN for prompts; so the panels are the one packed copy of a weight.
PANEL_MAX_ROWS = 96
PANEL_DTYPES = (torch.float32, torch.bfloat16)  # what the panels may hold


_SIGNATURES = {  # name: (argtypes, restype)
    "xllm_paged_decode_attention_f32": (
        ["p", "p", "p", "p", "i64", "p", "i64", "p", "i32", "i32", "i32", "i32", "i32", "f32",
         "i64"], "int"),
    "xllm_add_rms_norm_f32": (["p", "p", "p", "p", "i64", "i32", "f32"], None),
    "xllm_qk_norm_rope_store_f32": (
        ["p", "p", "p", "p", "p", "p", "p", "f32", "p", "p", "i64", "i32", "i32", "i32"], "int"),
    "xllm_silu_and_mul_f32": (["p", "p", "i64", "i32"], None),
    "xllm_gelu_tanh_and_mul_f32": (["p", "p", "i64", "i32"], None),
    "xllm_linear_panels_f32": (["p", "p", "p", "p", "i32", "i32", "i32"], "int"),
    "xllm_linear_large_f32": (["p", "p", "p", "p", "i32", "i32", "i32"], "int"),
    "xllm_linear_panels_bf16": (["p", "p", "p", "p", "i32", "i32", "i32"], "int"),
    "xllm_linear_panels_i8": (["p", "p", "p", "p", "p", "i32", "i32", "i32"], "int"),
    "xllm_linear_large_bf16": (["p", "p", "p", "p", "i32", "i32", "i32"], "int"),
    "xllm_copy_chunks": (["p", "p", "i64"], None),
    "xllm_int8_blocks": (["p", "i64", "p", "p"], "int"),
    "xllm_linear_panels_kq": (
        ["i32", "p", "p", "p", "p", "p", "p", "p", "p", "i32", "i32", "i32"], "int"),
    "xllm_linear_large_kq": (
        ["i32", "p", "p", "p", "p", "p", "p", "p", "p", "i32", "i32", "i32"], "int"),
    "xllm_linear_large_i8": (["p", "p", "p", "p", "p", "i32", "i32", "i32"], "int"),
    "xllm_dequant_panels_kq": (["i32", "p", "p", "p", "p", "p", "i32", "i32", "p"], "int"),
    "xllm_head_argmax": (["i32", "p", "p", "p", "p", "p", "i32", "i32", "i32"], "int"),
    "xllm_head_argmax_vnni": (["p", "p", "p", "p", "p", "p", "i32", "i32", "i32"], "int"),
    "xllm_sample_rows_f32": (["p", "i64", "i32", "i32", "p", "p", "p", "p", "p", "p"], "int"),
}
_CTYPES = {"p": ctypes.c_void_p, "i64": ctypes.c_int64, "i32": ctypes.c_int32,
           "f32": ctypes.c_float, "int": ctypes.c_int, None: None}


def _open(config: KernelConfig) -> tuple[ctypes.CDLL, str, pathlib.Path]:
    """Builds (or finds) the library for ``config`` and loads it, its functions typed;
    with the instruction set it was built for (kernel_build.choose_isa)."""
    isa_name = kernel_build.choose_isa(config.isa, kernel_build.cpu_flags())
    path = kernel_build.build(config, isa_name)
    lib = ctypes.CDLL(str(path))
    for name, (args, res) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = [_CTYPES[a] for a in args]
        fn.restype = _CTYPES[res]
    return lib, isa_name, path


def _load() -> ctypes.CDLL | None:
    global _lib, _lib_isa, _tried, _why_not
    if _off:
        return None
    if _tried:  # every kernel call comes here: no lock once decided
        return _lib
    with _lock:
        if _tried:
            return _lib
        _tried = True
        config = KernelConfig.from_env()
        if not config.enabled:
            _why_not = "disabled by XLLM_CPU_KERNELS"
            return None
        try:
            lib, isa_name, path = _open(config)
        except Exception as e:  # noqa: BLE001 - any failure means: use the torch path
            _why_not = str(e)
            logger.warning("CPU kernels unavailable, using the torch path: %s", e)
            return None
        _lib, _lib_isa = lib, isa_name
        logger.info("CPU kernels (%s) loaded from %s", isa_name or "scalar", path)
        return _lib


def isa() -> str:
    """What the kernels in use were built for: "avx512", "avx2" or "" (scalar, or none:
    kernel_build.choose_isa)."""
    return _lib_isa if _load() is not None else ""


@contextlib.contextmanager
def built_for(isa_name: str) -> Iterator[None]:
    """Within the block every kernel call goes to the build for ``isa_name`` ("avx2" or
    "avx512", which the CPU must have): tests compare the builds in one process. Not for
    use while other threads call the kernels."""
    global _lib, _lib_isa, _tried
    if kernel_build.choose_isa(isa_name, kernel_build.cpu_flags()) != isa_name:
        raise ValueError(f"this CPU cannot run the {isa_name} kernels")
    lib, _, _ = _open(dataclasses.replace(KernelConfig.from_env(), isa=isa_name))
    _load()  # decide the default first, so that it is restored afterwards
    prev = _lib, _lib_isa, _tried
    _lib, _lib_isa, _tried = lib, isa_name, True
    try:
        yield
    finally:
        _lib, _lib_isa, _tried = prev


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Within the block every caller takes the torch path (tests compare the two)."""
    global _off
    prev, _off = _off, True
    try:
        yield
    finally:
        _off = prev


def available() -> bool:
    return _load() is not None


def linear_available() -> bool:
    """Whether linear_panels / linear_large (and the fused decode step) run natively here:
    the library was built with AVX2/FMA. Without, they are stubs that decline every call,
    and the fused step is not built at all (its symbol tells the two builds apart)."""
    lib = _load()
    return lib is not None and hasattr(lib, "xllm_decode_stack_f32")


def vnni_available() -> bool:
    """Whether csrc/head_vnni.c's integer pass runs here: the native linears, and a CPU
    with AVX512-VNNI (the function is built for it whatever the library's ISA)."""
    return linear_available() and {"avx512_vnni", *kernel_build.AVX512} <= kernel_build.cpu_flags()


def unavailable_reason() -> str:
    _load()
    return _why_not


def _f32_cpu(*ts: torch.Tensor) -> bool:
    for t in ts:  # a loop, not all(genexpr): called for every kernel call
        if t.dtype is not torch.float32 or not t.is_cpu:
            return False
    return True


def _cache_layout_ok(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """K and V ``[num_blocks, bs, kvh, hd]`` float32 on CPU, each block contiguous, the
    same strides (per-layer views of one pool qualify): what the kernels address."""
    if not _f32_cpu(k_cache, v_cache) or k_cache.stride() != v_cache.stride():
        return False
    bs, kvh, hd = k_cache.shape[1:]
    return k_cache.stride()[1:] == (kvh * hd, hd, 1) and k_cache.stride(0) >= bs * kvh * hd


def kv_store_layout_ok(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """``_cache_layout_ok`` with the blocks adjacent: the layout the K/V store addresses as
    one flat ``[num_slots, kvh, hd]`` array (the q/k-norm + RoPE + store kernel, and the
    fused decode layer, which contains it)."""
    bs, kvh, hd = k_cache.shape[1:]
    return _cache_layout_ok(k_cache, v_cache) and k_cache.stride(0) == bs * kvh * hd


def decode_attention_supported(q: torch.Tensor, k_cache: torch.Tensor,
                               v_cache: torch.Tensor) -> bool:
    """Whether ``paged_decode_attention`` handles these tensors (else: torch path)."""
    if not _f32_cpu(q) or not _cache_layout_ok(k_cache, v_cache):
        return False
    h, hd = q.shape[1], q.shape[2]
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    return (h % kvh == 0 and h // kvh <= MAX_GROUP and hd <= MAX_HEAD_DIM
            and bs <= MAX_BLOCK_SIZE and available())


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float, window: int = 0) -> torch.Tensor:
    """q [B, h, hd] (one new token per sequence, its K/V already written) -> [B, h, hd].

    ``block_tables`` [B, >= ceil(seq_len / block_size)] int64 with unit column stride,
    ``seq_lens`` [B] int64 (context including the new token). Caches
    ``[num_blocks, block_size, kvh, hd]`` with contiguous blocks (per-layer views of one
    pool are fine). ``window`` > 0: each query reads only its last ``window`` positions
    (sliding-window attention). The caller checked ``decode_attention_supported``.
    """
    lib = _load()
    assert lib is not None
    q = q.contiguous()
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    seq_lens = seq_lens.contiguous()
    b, h, hd = q.shape
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    rc = lib.xllm_paged_decode_attention_f32(
        q.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        k_cache.stride(0), block_tables.data_ptr(), block_tables.stride(0),
        seq_lens.data_ptr(), b, h, kvh, hd, bs, scale, window)
    if rc != 0:
        raise ValueError(f"paged_decode_attention: unsupported sizes h={h} kvh={kvh} "
                         f"hd={hd} block_size={bs}")
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | None:
    """``rmsnorm(x) * w``; with ``residual``: ``residual += x`` in place first and the norm
    is of the sum. x/residual [T, H] contiguous float32. None: not handled (torch path)."""
    if x.dim() != 2 or not _f32_cpu(x, weight) or not x.is_contiguous() or _load() is None:
        return None
    if residual is not None and (not _f32_cpu(residual) or not residual.is_contiguous()
                                 or residual.shape != x.shape):
        return None
    out = torch.empty_like(x)
    _lib.xllm_add_rms_norm_f32(x.data_ptr(), 0 if residual is None else residual.data_ptr(),
                               weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps)
    return out


def qk_norm_rope_store(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                       q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                       cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor | None:
    """From the fused projection qkv [T, (h + 2 kvh) * hd]: returns q [T, h, hd] after the
    optional per-head RMSNorm and neox RoPE, and stores k (same treatment) and v at
    ``slot_mapping`` in the caches. cos/sin [T, hd] (or [T, 1, hd]). None: torch path."""
    if _load() is None or head_dim > MAX_HEAD_DIM or head_dim % 2:
        return None
    if not _f32_cpu(qkv, cos, sin) or not qkv.is_contiguous():
        return None
    if (q_weight is None) != (k_weight is None):
        return None
    if not kv_store_layout_ok(k_cache, v_cache) or k_cache.shape[2:] != (num_kv_heads, head_dim):
        return None
    t = qkv.shape[0]
    cos = cos.reshape(t, head_dim).contiguous()
    sin = sin.reshape(t, head_dim).contiguous()
    slots = slot_mapping.contiguous()
    q = torch.empty(t, num_heads, head_dim, dtype=qkv.dtype)
    rc = _lib.xllm_qk_norm_rope_store_f32(
        qkv.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(),
        0 if q_weight is None else q_weight.data_ptr(),
        0 if k_weight is None else k_weight.data_ptr(), eps, cos.data_ptr(), sin.data_ptr(),
        t, num_heads, num_kv_heads, head_dim)
    return q if rc == 0 else None


def silu_and_mul(x: torch.Tensor, gelu: bool = False,
                 out: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [T, 2I] = [gate | up] -> silu(gate) * up [T, I]; ``gelu``: gelu_tanh(gate) * up
    (GeGLU). Into ``out`` when given (contiguous float32 [T, I]). None: torch path."""
    if x.dim() != 2 or not _f32_cpu(x) or not x.is_contiguous() or _load() is None:
        return None
    half = x.shape[1] // 2
    if out is None:
        out = torch.empty(x.shape[0], half, dtype=x.dtype)
    fn = _lib.xllm_gelu_tanh_and_mul_f32 if gelu else _lib.xllm_silu_and_mul_f32
    fn(x.data_ptr(), out.data_ptr(), x.shape[0], half)
    return out


def pack_panels(weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """nn.Linear's weight [N, K] -> panels [ceil(N/16), K, 16] for ``linear_panels``, in
    ``dtype`` (float32 or bfloat16; default: the weight's)."""
    n, k = weight.shape
    num = (n + 15) // 16
    padded = weight.new_zeros(num * 16, k, dtype=dtype or weight.dtype)
    padded[:n] = weight
    return padded.view(num, 16, k).transpose(1, 2).contiguous()



def linear_panels(x: torch.Tensor, panels: torch.Tensor, out_features: int,
                  bias: torch.Tensor | None) -> torch.Tensor | None:
    """``x @ W.T + bias`` for x [M <= PANEL_MAX_ROWS, K] float32 with W packed by
    ``pack_panels`` (float32 or bfloat16 panels; the sums are float32 either way).
    None: not handled (take another path)."""
    return _panel_linear("xllm_linear_panels", x, panels, out_features, bias,
                         PANEL_MAX_ROWS)


def linear_large(x: torch.Tensor, panels: torch.Tensor, out_features: int,
                 bias: torch.Tensor | None) -> torch.Tensor | None:
    """``x @ W.T + bias`` for x [M, K] float32 (any M; meant for M > PANEL_MAX_ROWS, the
    prefill sizes) with W packed by ``pack_panels``. None: not handled (unsupported
    tensors, no kernels, or the kernel declined, e.g. out of memory): take another path.
    float32 or bfloat16 panels."""
    return _panel_linear("xllm_linear_large", x, panels, out_features, bias, 2**31 - 1)


def linear_panels_int8(x: torch.Tensor, panels: torch.Tensor, scales: torch.Tensor,
                       out_features: int, bias: torch.Tensor | None) -> torch.Tensor | None:
    """``x @ W.T + bias`` for x [M, K] float32 with W as int8 panels [ceil(N/16), K, 16] and
    float32 scales [ceil(N/16), K/32, 16] (int8_panels.py): the sums of float32 panels
    holding the same values (linear_panels' up to PANEL_MAX_ROWS rows, linear_large's
    past that). None: not handled."""
    if (x.dim() != 2 or not 0 < x.shape[0] or not x.is_contiguous()
            or not _f32_cpu(x) or panels.dtype != torch.int8 or not panels.is_contiguous()
            or not _f32_cpu(scales) or not scales.is_contiguous() or _load() is None):
        return None
    if bias is not None and (not _f32_cpu(bias) or not bias.is_contiguous()):
        return None
    k = panels.shape[1]
    if x.shape[1] != k or panels.shape[0] * 16 < out_features or k % 32:
        raise ValueError(f"linear: input has {x.shape[1]} features, weight expects {k}")
    y = torch.empty(x.shape[0], out_features, dtype=x.dtype)
    fn = _lib.xllm_linear_panels_i8 if x.shape[0] <= PANEL_MAX_ROWS else _lib.xllm_linear_large_i8
    rc = fn(x.data_ptr(), panels.data_ptr(), scales.data_ptr(),
            0 if bias is None else bias.data_ptr(), y.data_ptr(), x.shape[0], out_features, k)
    return y if rc == 0 else None


def linear_panels_kquant(x: torch.Tensor, kq: KQuantPanels,
                         bias: torch.Tensor | None) -> torch.Tensor | None:
    """``x @ W.T + bias`` for x [M, K] float32 with W as GGUF Q4_K / Q6_K panels
    (kquant_panels.py): the sums of float32 panels holding the dequantized weight
    (linear_panels' up to PANEL_MAX_ROWS rows, linear_large's past that). None: not
    handled."""
    if (x.dim() != 2 or not 0 < x.shape[0] or not x.is_contiguous()
            or not _f32_cpu(x) or _load() is None):
        return None
    if bias is not None and (not _f32_cpu(bias) or not bias.is_contiguous()):
        return None
    if x.shape[1] != kq.in_features:
        raise ValueError(f"linear: input has {x.shape[1]} features, weight expects "
                         f"{kq.in_features}")
    y = torch.empty(x.shape[0], kq.out_features, dtype=x.dtype)
    t, q, sc, mn, d, dm = kq.args
    fn = _lib.xllm_linear_panels_kq if x.shape[0] <= PANEL_MAX_ROWS else _lib.xllm_linear_large_kq
    rc = fn(t, x.data_ptr(), q, sc, mn, d, dm, 0 if bias is None else bias.data_ptr(),
            y.data_ptr(), x.shape[0], kq.out_features, kq.in_features)
    return y if rc == 0 else None


def dequantize_kquant_panels(kq: KQuantPanels) -> torch.Tensor | None:
    """The float32 panels [np, K, 16] the kernels widen ``kq`` to; None without them."""
    if _load() is None:
        return None
    out = torch.empty(kq.num_panels, kq.in_features, 16, dtype=torch.float32)
    rc = _lib.xllm_dequant_panels_kq(*kq.args, kq.num_panels, kq.in_features, out.data_ptr())
    return out if rc == 0 else None


def int8_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(q [N, K] int8, scales [N, K/32]) when every 32-value block of the float32 weight
    [N, K] is exactly scale * integer (int8_panels.py), else None (also without kernels)."""
    if (weight.dim() != 2 or not _f32_cpu(weight) or weight.shape[1] % 32
            or _load() is None):
        return None
    w = weight.contiguous()
    q = torch.empty(w.shape, dtype=torch.int8)
    s = torch.empty(w.shape[0], w.shape[1] // 32, dtype=torch.float32)
    rc = _lib.xllm_int8_blocks(w.data_ptr(), w.numel() // 32, q.data_ptr(), s.data_ptr())
    return (q, s) if rc == 0 else None


def _panel_linear(fn: str, x: torch.Tensor, panels: torch.Tensor, out_features: int,
                  bias: torch.Tensor | None, max_rows: int) -> torch.Tensor | None:
    """One of the panel GEMM entry points (``fn`` + ``_f32`` / ``_bf16`` by the panels'
    dtype) on checked tensors; None when it does not apply or the kernel declines."""
    if (x.dim() != 2 or not 0 < x.shape[0] <= max_rows or not x.is_contiguous()
            or not _f32_cpu(x) or panels.device.type != "cpu"
            or panels.dtype not in PANEL_DTYPES or not panels.is_contiguous()
            or _load() is None):
        return None
    if bias is not None and (not _f32_cpu(bias) or not bias.is_contiguous()):
        return None
    k = panels.shape[1]
    if x.shape[1] != k or panels.shape[0] * 16 < out_features:
        raise ValueError(f"linear: input has {x.shape[1]} features, weight expects {k}")
    y = torch.empty(x.shape[0], out_features, dtype=x.dtype)
    fn += "_bf16" if panels.dtype == torch.bfloat16 else "_f32"
    rc = getattr(_lib, fn)(x.data_ptr(), panels.data_ptr(),
                           0 if bias is None else bias.data_ptr(), y.data_ptr(),
                           x.shape[0], out_features, k)
    return y if rc == 0 else None


def copy_chunks(dst: np.ndarray, src: np.ndarray) -> bool:
    """memcpy each (address, length) row of ``src`` to the same row of ``dst`` (uint64 [n, 2],
    C-contiguous, equal lengths), in one native call without the GIL; False when the
    kernels are unavailable (the caller copies another way)."""
    lib = _load()
    if lib is None:
        return False
    if dst.shape != src.shape or dst.dtype.itemsize != 8 or src.dtype.itemsize != 8:
        raise ValueError("copy_chunks: dst and src must be uint64 [n, 2] of equal shape")
    if not (dst.flags.c_contiguous and src.flags.c_contiguous):
        raise ValueError("copy_chunks: dst and src must be C-contiguous")
    if (dst[:, 1] != src[:, 1]).any():
        raise ValueError("copy_chunks: chunk lengths differ between dst and src")
    lib.xllm_copy_chunks(dst.ctypes.data, src.ctypes.data, dst.shape[0])
    return True
