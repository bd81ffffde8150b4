"""Decode steps through one native call (csrc/decode_layer.c).

A decode-only batch of up to ``cpu_kernels.PANEL_MAX_ROWS`` sequences runs every layer,
and with ``logits`` also the final norm and the LM head, in one parallel region that
chains the kernels of ``cpu_kernels`` (RMSNorm, panel GEMMs, q/k norm + RoPE + KV store,
paged attention, SiLU): one thread-team wake-up and one call from Python per step instead
of ~10 per layer, intermediates in one reused scratch buffer. The floats are those of the
per-op path (the same kernel bodies in the same order).

It applies when every linear of the model is a ``PackedLinear`` with panels (the engine
packs float32 CPU models; float32 or bfloat16 panels, one dtype per layer), the kernels
are loaded and the caches have the layout the kernels address; ``FusedDecoder.run`` /
``logits`` return None otherwise and the caller takes the per-op path. One caller at a
time per model (the engine thread): the scratch is shared.
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
        ("hidden", _i32), ("num_heads", _i32), ("num_kv_heads", _i32), ("head_dim", _i32),
        ("intermediate", _i32), ("rms_eps", _f32), ("qk_eps", _f32), ("scale", _f32),
        ("input_norm", _p), ("post_norm", _p), ("q_norm", _p), ("k_norm", _p),
        ("qkv_w", _p), ("qkv_b", _p), ("o_w", _p), ("o_b", _p),
        ("gate_up_w", _p), ("gate_up_b", _p), ("down_w", _p), ("down_b", _p),
        ("k_cache", _p), ("v_cache", _p), ("weight_bf16", _i32),
    ]


class StepArgs(ctypes.Structure):
    """``struct xllm_decode_step`` (same field order and types)."""

    _fields_ = [
        ("T", _i64), ("block_size", _i32), ("block_stride", _i64), ("table_stride", _i64),
        ("slots", _p), ("tables", _p), ("seq_lens", _p), ("cos", _p), ("sin", _p),
        ("ids", _p), ("positions", _p), ("embed", _p), ("cos_table", _p), ("sin_table", _p),
        ("embed_rows", _i64), ("table_rows", _i64),
        ("residual", _p), ("out0", _p), ("out1", _p), ("scratch", _p),
        ("final_norm", _p), ("lm_w", _p), ("lm_b", _p), ("final_eps", _f32), ("vocab", _i32),
        ("logits", _p), ("lm_bf16", _i32),
    ]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _f32_contiguous(*ts: torch.Tensor | None) -> bool:
    return all(t is None or (t.dtype == torch.float32 and t.device.type == "cpu"
                             and t.is_contiguous()) for t in ts)


def _panels_ok(*ms: PackedLinear) -> bool:
    """Contiguous CPU panels of one dtype the kernels read (float32 or bfloat16)."""
    ps = [m._panels for m in ms]
    return all(p.device.type == "cpu" and p.is_contiguous() and p.dtype == ps[0].dtype
               for p in ps) and ps[0].dtype in cpu_kernels.PANEL_DTYPES


def supported() -> bool:
    """Whether the loaded kernels have the fused decode stack (AVX2/FMA builds)."""
    return cpu_kernels.linear_available()


class FusedDecoder:
    def __init__(self, lib: ctypes.CDLL, layers: ctypes.Array, keep: list,
                 head: tuple | None) -> None:
        self._lib = lib
        self._layers = layers  # LayerArgs * num_layers
        self._keep = keep  # the tensors whose pointers the structs hold
        # (final norm weight, eps, LM head panels, bias, vocab), or None: no fused head
        self._head = head
        self._step = StepArgs()
        self._scratch = torch.empty(0)
        self._lock = threading.Lock()

    @property
    def has_head(self) -> bool:
        """Whether ``logits`` runs the final norm and the LM head natively too."""
        return self._head is not None

    @classmethod
    def build(cls, model: torch.nn.Module) -> "FusedDecoder | None":
        """A decoder for ``model`` (LlamaForCausalLM), or None when it does not apply."""
        if not supported():
            return None
        lib = cpu_kernels._load()
        lib.xllm_decode_stack_f32.argtypes = [ctypes.POINTER(LayerArgs), ctypes.c_int32,
                                              ctypes.POINTER(StepArgs)]
        lib.xllm_decode_stack_f32.restype = ctypes.c_int
        lib.xllm_decode_stack_scratch.argtypes = [ctypes.POINTER(LayerArgs), ctypes.c_int64]
        lib.xllm_decode_stack_scratch.restype = ctypes.c_int64
        cfg = model.config
        if cfg.head_dim % 2 or not len(model.model.layers):
            return None
        layers, keep = [], []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if not all(_has_panels(m) for m in linears):
                return None
            if ((attn.q_norm is None) != (attn.k_norm is None)  # the per-op path: neither
                    or layer.post_attention_layernorm.eps != layer.input_layernorm.eps):
                return None
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                     None if attn.q_norm is None else attn.q_norm.weight,
                     None if attn.k_norm is None else attn.k_norm.weight)
            if not (_f32_contiguous(*norms, *(m.bias for m in linears))
                    and _panels_ok(*linears)):
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
                down_w=_ptr(mlp.down_proj._panels), down_b=_ptr(mlp.down_proj.bias),
                weight_bf16=int(attn.qkv_proj._panels.dtype == torch.bfloat16)))
            keep.append((norms, linears))
        head = None
        norm, lm_head = model.model.norm, model.lm_head
        embed = model.model.embed_tokens.weight
        if (_has_panels(lm_head) and lm_head.in_features == cfg.hidden_size
                and embed.shape[1] == cfg.hidden_size
                and _f32_contiguous(norm.weight, lm_head.bias, embed) and _panels_ok(lm_head)):
            head = (norm.weight, norm.eps, lm_head._panels, lm_head.bias, lm_head.out_features,
                    embed)
        return cls(lib, (LayerArgs * len(layers))(*layers), keep, head)

    def run(self, hidden: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
            kv_caches: list, plan) -> tuple[torch.Tensor, torch.Tensor] | None:
        """All layers for a decode-only ``plan`` from the embeddings ``hidden`` [T, hidden]
        and RoPE rows ``cos_sin``: returns (last MLP output, residual), or None (nothing
        done) when this batch or these caches do not qualify."""
        t = int(hidden.shape[0])
        if not _f32_contiguous(hidden):
            return None
        hd = self._layers[0].head_dim
        cos = cos_sin[0].reshape(t, hd).contiguous()
        sin = cos_sin[1].reshape(t, hd).contiguous()
        return self._run(t, kv_caches, plan, hidden, (cos, sin), None)

    def logits(self, input_ids: torch.Tensor, positions: torch.Tensor,
               rope_tables: tuple[torch.Tensor, torch.Tensor], kv_caches: list,
               plan) -> torch.Tensor | None:
        """The whole step for a decode-only ``plan`` from the token ids: the embedding rows
        and the RoPE rows of ``positions`` (from ``rope_tables``, cos and sin [P, head_dim])
        are gathered natively too. Returns logits [T, vocab], or None (nothing done) when
        this batch, these caches, ids or this model's head do not qualify."""
        if self._head is None:
            return None
        cos_t, sin_t = rope_tables
        if not (input_ids.dtype == positions.dtype == torch.int64
                and input_ids.is_contiguous() and positions.is_contiguous()
                and _f32_contiguous(cos_t, sin_t) and cos_t.shape == sin_t.shape
                and cos_t.dim() == 2 and cos_t.shape[1] == self._layers[0].head_dim):
            return None
        t = int(input_ids.shape[0])
        residual = torch.empty(t, self._layers[0].hidden, dtype=torch.float32)
        return self._run(t, kv_caches, plan, residual, None,
                         (input_ids, positions, cos_t, sin_t))

    def _run(self, t: int, kv_caches: list, plan, residual: torch.Tensor,
             rope_rows: tuple[torch.Tensor, torch.Tensor] | None, gather: tuple | None):
        """``residual`` holds the embeddings (``gather`` None) or receives them (gather:
        ids, positions, cos table, sin table); with ``gather`` the head runs too."""
        d = plan.decode
        if (plan.prefill is not None or d is None or d.token_idx is not None
                or cpu_kernels._load() is None or not 0 < t <= cpu_kernels.PANEL_MAX_ROWS):
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
        outs = (torch.empty_like(residual), torch.empty_like(residual))
        logits = None
        with self._lock:
            layers, s = self._layers, self._step
            for args, (k, v) in zip(layers, kv_caches):
                args.k_cache, args.v_cache = k.data_ptr(), v.data_ptr()
            need = self._lib.xllm_decode_stack_scratch(layers, t)
            if self._scratch.numel() < need:
                self._scratch = torch.empty(need, dtype=torch.float32)
            s.T, s.block_size = t, bs
            s.block_stride, s.table_stride = k0.stride(0), tables.stride(0)
            s.slots, s.tables, s.seq_lens = slots.data_ptr(), tables.data_ptr(), lens.data_ptr()
            s.residual, s.out0, s.out1 = residual.data_ptr(), outs[0].data_ptr(), outs[1].data_ptr()
            s.scratch = self._scratch.data_ptr()
            if gather is None:
                s.cos, s.sin = rope_rows[0].data_ptr(), rope_rows[1].data_ptr()
                s.ids = s.positions = s.embed = s.cos_table = s.sin_table = None
                s.embed_rows = s.table_rows = 0
                s.final_norm = s.lm_w = s.lm_b = s.logits = None
                s.vocab = s.lm_bf16 = 0
            else:
                ids, positions, cos_t, sin_t = gather
                norm_w, eps, panels, bias, vocab, embed = self._head
                logits = torch.empty(t, vocab, dtype=torch.float32)
                s.cos = s.sin = None
                s.ids, s.positions = ids.data_ptr(), positions.data_ptr()
                s.embed, s.embed_rows = embed.data_ptr(), embed.shape[0]
                s.cos_table, s.sin_table = cos_t.data_ptr(), sin_t.data_ptr()
                s.table_rows = cos_t.shape[0]
                s.final_norm, s.final_eps = norm_w.data_ptr(), eps
                s.lm_w, s.lm_b, s.vocab = panels.data_ptr(), _ptr(bias), vocab
                s.lm_bf16 = int(panels.dtype == torch.bfloat16)
                s.logits = logits.data_ptr()
            rc = self._lib.xllm_decode_stack_f32(layers, len(layers), ctypes.byref(s))
        if rc == -1:  # sizes the kernels do not take: nothing ran
            return None
        if rc != 0:
            raise RuntimeError(f"fused decode step failed (code {rc}): {t} tokens, "
                               f"block size {bs}")
        if gather is not None:
            return logits
        return outs[(len(layers) - 1) % 2], residual


def _has_panels(m: torch.nn.Module) -> bool:
    return isinstance(m, PackedLinear) and m._panels is not None
