"""Decode steps through one native call per decoder layer (csrc/decode_layer.c).

A decode-only batch of up to ``cpu_kernels.PANEL_MAX_ROWS`` sequences runs each layer as
one parallel region that chains the kernels of ``cpu_kernels`` (RMSNorm, panel GEMMs,
q/k norm + RoPE + KV store, paged attention, SiLU): one thread-team wake-up and one
Python call per layer instead of nine, intermediates in one reused scratch buffer. The
floats are those of the per-op path (the same kernel bodies in the same order).

It applies when every linear of the model is a ``PackedLinear`` with panels (the engine
packs float32 CPU models), the kernels are loaded and the caches have the layout the
kernels address; ``FusedDecoder.run`` returns None otherwise and the caller takes the
per-op path. One caller at a time per model (the engine thread): the scratch is shared.
"""
from __future__ import annotations

import ctypes
import logging
import threading

import torch

from xllm_py.model import cpu_kernels
from xllm_py.model.packed import PackedLinear

logger = logging.getLogger(__name__)

_p, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float


class LayerArgs(ctypes.Structure):
    """``struct xllm_decode_layer`` (same field order and types)."""

    _fields_ = [
        ("T", _i64), ("hidden", _i32), ("num_heads", _i32), ("num_kv_heads", _i32),
        ("head_dim", _i32), ("intermediate", _i32), ("block_size", _i32),
        ("rms_eps", _f32), ("qk_eps", _f32), ("scale", _f32),
        ("input_norm", _p), ("post_norm", _p), ("q_norm", _p), ("k_norm", _p),
        ("qkv_w", _p), ("qkv_b", _p), ("o_w", _p), ("o_b", _p),
        ("gate_up_w", _p), ("gate_up_b", _p), ("down_w", _p), ("down_b", _p),
        ("k_cache", _p), ("v_cache", _p), ("block_stride", _i64), ("table_stride", _i64),
        ("slots", _p), ("tables", _p), ("seq_lens", _p), ("cos", _p), ("sin", _p),
        ("x", _p), ("residual", _p), ("out", _p), ("scratch", _p),
    ]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _f32_contiguous(*ts: torch.Tensor | None) -> bool:
    return all(t is None or (t.dtype == torch.float32 and t.device.type == "cpu"
                             and t.is_contiguous()) for t in ts)


def supported() -> bool:
    """Whether the loaded kernels have the fused layer (AVX2/FMA builds)."""
    lib = cpu_kernels._load()
    return lib is not None and hasattr(lib, "xllm_decode_layer_f32")


class FusedDecoder:
    def __init__(self, lib: ctypes.CDLL, layers: list[LayerArgs], keep: list) -> None:
        self._lib = lib
        self._layers = layers
        self._keep = keep  # the tensors whose pointers the structs hold
        self._scratch = torch.empty(0)
        self._lock = threading.Lock()

    @classmethod
    def build(cls, model: torch.nn.Module) -> "FusedDecoder | None":
        """A decoder for ``model`` (LlamaForCausalLM), or None when it does not apply."""
        if not supported():
            return None
        lib = cpu_kernels._load()
        lib.xllm_decode_layer_f32.argtypes = [ctypes.POINTER(LayerArgs)]
        lib.xllm_decode_layer_f32.restype = ctypes.c_int
        lib.xllm_decode_layer_scratch.argtypes = [ctypes.POINTER(LayerArgs)]
        lib.xllm_decode_layer_scratch.restype = ctypes.c_int64
        cfg = model.config
        if cfg.head_dim % 2 or not len(model.model.layers):
            return None
        layers, keep = [], []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if not all(isinstance(m, PackedLinear) and m._panels is not None for m in linears):
                return None
            if ((attn.q_norm is None) != (attn.k_norm is None)  # the per-op path: neither
                    or layer.post_attention_layernorm.eps != layer.input_layernorm.eps):
                return None
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                     None if attn.q_norm is None else attn.q_norm.weight,
                     None if attn.k_norm is None else attn.k_norm.weight)
            if not _f32_contiguous(*norms, *(m._panels for m in linears),
                                   *(m.bias for m in linears)):
                return None
            layers.append(LayerArgs(
                hidden=cfg.hidden_size, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                head_dim=cfg.head_dim, intermediate=mlp.down_proj.in_features,
                rms_eps=layer.input_layernorm.eps,
                qk_eps=attn.q_norm.eps if attn.q_norm is not None else 0.0,
                scale=cfg.head_dim ** -0.5,
                input_norm=_ptr(norms[0]), post_norm=_ptr(norms[1]),
                q_norm=_ptr(norms[2]), k_norm=_ptr(norms[3]),
                qkv_w=_ptr(attn.qkv_proj._panels), qkv_b=_ptr(attn.qkv_proj.bias),
                o_w=_ptr(attn.o_proj._panels), o_b=_ptr(attn.o_proj.bias),
                gate_up_w=_ptr(mlp.gate_up_proj._panels), gate_up_b=_ptr(mlp.gate_up_proj.bias),
                down_w=_ptr(mlp.down_proj._panels), down_b=_ptr(mlp.down_proj.bias)))
            keep.append((norms, linears))
        return cls(lib, layers, keep)

    def run(self, hidden: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
            kv_caches: list, plan) -> tuple[torch.Tensor, torch.Tensor] | None:
        """All layers for a decode-only ``plan``: returns (last MLP output, residual), or
        None (nothing done) when this batch or these caches do not qualify."""
        d = plan.decode
        if (plan.prefill is not None or d is None or d.token_idx is not None
                or cpu_kernels._load() is None):
            return None
        t = int(hidden.shape[0])
        if not 0 < t <= cpu_kernels.PANEL_MAX_ROWS or not _f32_contiguous(hidden):
            return None
        k0, v0 = kv_caches[0]
        bs, hd = k0.shape[1], k0.shape[3]
        if (not cpu_kernels.kv_store_layout_ok(k0, v0) or hd != self._layers[0].head_dim
                or any(k.stride() != k0.stride() for kv in kv_caches for k in kv)):
            return None
        tables, lens, slots = d.block_tables, d.seq_lens, plan.slot_mapping
        if tables.stride(1) != 1:  # rows may be a view of a wider table: unit columns only
            tables = tables.contiguous()
        if not (all(x.dtype == torch.int64 for x in (tables, lens, slots))
                and lens.is_contiguous() and slots.is_contiguous()):
            return None
        cos = cos_sin[0].reshape(t, hd).contiguous()
        sin = cos_sin[1].reshape(t, hd).contiguous()
        residual = hidden
        outs = (torch.empty_like(hidden), torch.empty_like(hidden))
        with self._lock:
            for i, (args, (k, v)) in enumerate(zip(self._layers, kv_caches)):
                args.T, args.block_size = t, bs
                if i == 0:
                    need = self._lib.xllm_decode_layer_scratch(ctypes.byref(args))
                    if self._scratch.numel() < need:
                        self._scratch = torch.empty(need, dtype=torch.float32)
                args.k_cache, args.v_cache = k.data_ptr(), v.data_ptr()
                args.block_stride, args.table_stride = k.stride(0), tables.stride(0)
                args.slots, args.tables, args.seq_lens = (slots.data_ptr(), tables.data_ptr(),
                                                          lens.data_ptr())
                args.cos, args.sin = cos.data_ptr(), sin.data_ptr()
                args.x = None if i == 0 else outs[(i - 1) % 2].data_ptr()
                args.residual, args.out = residual.data_ptr(), outs[i % 2].data_ptr()
                args.scratch = self._scratch.data_ptr()
                rc = self._lib.xllm_decode_layer_f32(ctypes.byref(args))
                if rc == -1 and i == 0:  # sizes the kernels do not take: nothing ran
                    return None
                if rc != 0:
                    raise RuntimeError(f"fused decode layer {i} failed (code {rc}): "
                                       f"{t} tokens, block size {bs}")
        return outs[(len(self._layers) - 1) % 2], residual
