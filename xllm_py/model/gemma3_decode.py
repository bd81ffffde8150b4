"""Decode steps of a packed Gemma 3 model with the per-op path's Python cut down.

The Gemma 3 block (gemma3.py) is not in the fused native decode stack (fused_decode.py:
its sandwich norms, GELU and sliding windows), so a decode step calls its kernels one by
one, each through a module, a wrapper that checks its tensors and a fresh output tensor:
on gemma-3-270m at batch 1 that Python was ~20% of a step. ``Gemma3DecodeRunner`` makes
the same calls in the same order with the same inputs -- RMSNorm, the four panel GEMMs
(float32, bfloat16, int8 or K-quant panels), q/k-norm + RoPE + KV store, then
``attention.attend`` and the GeGLU kernel exactly as the block does -- straight into the
native library with every weight's arguments prepared once, the checks done once per step,
and the intermediates in buffers kept between steps: the floats of the per-op path, bit for
bit (tests/unit/model/test_gemma3_decode.py).

It applies to a decode-only batch of up to ``cpu_kernels.PANEL_MAX_ROWS`` sequences when
every linear of every layer is a ``PackedLinear`` with panels and the kernels are loaded;
``run`` returns None otherwise (nothing done) and the caller takes the per-op path. One
caller at a time per model (the engine thread): the buffers are shared.
"""
from __future__ import annotations

import logging
import threading

import torch

from xllm_py.model import attention, cpu_kernels
from xllm_py.model.packed import PackedLinear

logger = logging.getLogger(__name__)


def _linear_call(lib, m: PackedLinear):
    """(function, args before x, args between x and y) of ``m``'s panel kernel, or None."""
    if not isinstance(m, PackedLinear) or m._panels is None:
        return None
    if m.bias is not None and not (m.bias.dtype == torch.float32 and m.bias.is_contiguous()):
        return None
    b = None if m.bias is None else m.bias.data_ptr()
    if m._kq is not None:
        t, q, sc, mn, d, dm = m._kq.args
        return lib.xllm_linear_panels_kq, (t,), (q, sc, mn, d, dm, b)
    if m._scales is not None:
        return lib.xllm_linear_panels_i8, (), (m._panels.data_ptr(), m._scales.data_ptr(), b)
    fn = {torch.float32: lib.xllm_linear_panels_f32,
          torch.bfloat16: lib.xllm_linear_panels_bf16}.get(m._panels.dtype)
    return None if fn is None else (fn, (), (m._panels.data_ptr(), b))


class _Layer:
    def __init__(self, lib, layer) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.linears = [(m, _linear_call(lib, m))
                        for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        norms = (layer.input_layernorm, layer.post_attention_layernorm,
                 layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm)
        self.norms = [(n.weight.data_ptr(), n.eps) for n in norms]
        self.ok = (all(c is not None for _, c in self.linears) and mlp.act == "gelu_pytorch_tanh"
                   and attn.q_norm is not None and attn.k_norm is not None
                   and all(n.weight.dtype == torch.float32 and n.weight.is_contiguous()
                           for n in norms + (attn.q_norm, attn.k_norm)))
        self.q_norm, self.k_norm, self.qk_eps = attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps
        self.q_scale = attn.q_scale
        self.inter = mlp.intermediate_size


class Gemma3DecodeRunner:
    def __init__(self, lib, layers: list[_Layer], config) -> None:
        self._lib = lib
        self._layers = layers
        self._hidden = config.hidden_size
        self._heads, self._kv_heads, self._head_dim = (config.num_heads, config.num_kv_heads,
                                                       config.head_dim)
        self._q, self._kv = config.q_size, config.kv_size
        self._buffers: dict[int, dict[str, torch.Tensor]] = {}
        self._lock = threading.Lock()

    @classmethod
    def build(cls, model: torch.nn.Module) -> "Gemma3DecodeRunner | None":
        """A runner for ``model`` (a packed Gemma 3 LlamaForCausalLM), or None."""
        cfg = model.config
        if not cfg.sandwich_norm or not cpu_kernels.linear_available():
            return None
        lib = cpu_kernels._load()
        if cfg.head_dim > cpu_kernels.MAX_HEAD_DIM or cfg.head_dim % 2:
            return None
        layers = [_Layer(lib, layer) for layer in model.model.layers]
        if not layers or not all(layer.ok for layer in layers):
            return None
        return cls(lib, layers, cfg)

    def _buffer(self, t: int) -> dict[str, torch.Tensor]:
        buf = self._buffers.get(t)
        if buf is None:
            inter = max(layer.inter for layer in self._layers)
            e = lambda *shape: torch.empty(*shape, dtype=torch.float32)  # noqa: E731
            buf = {"h": e(t, self._hidden), "qkv": e(t, self._q + 2 * self._kv),
                   "q": e(t, self._heads, self._head_dim), "o": e(t, self._hidden),
                   "gu": e(t * 2 * inter), "act": e(t * inter), "mlp": e(t, self._hidden),
                   "x": e(t, self._hidden)}
            self._buffers = {t: buf}  # the last batch size only
        return buf

    def _linear(self, i: int, j: int, x: torch.Tensor, y: torch.Tensor) -> None:
        m, (fn, pre, post) = self._layers[i].linears[j]
        t = x.shape[0]
        if fn(*pre, x.data_ptr(), *post, y.data_ptr(), t, m.out_features, m.in_features):
            y.copy_(m._linear_from_panels(x))  # declined (out of memory): the torch path

    def _norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: tuple[int, float],
              out: torch.Tensor) -> torch.Tensor:
        self._lib.xllm_add_rms_norm_f32(x.data_ptr(), 0 if residual is None else residual.data_ptr(),
                                        weight[0], out.data_ptr(), x.shape[0], x.shape[1],
                                        weight[1])
        return out

    def run(self, hidden: torch.Tensor, cos_sin: dict[int, tuple[torch.Tensor, torch.Tensor]],
            kv_caches: list, plans: dict, windows: list
            ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every layer for a decode-only step from the embeddings ``hidden`` [T, hidden]:
        (last layer's output, residual) as the per-op loop returns them, or None (nothing
        done) when this step does not qualify. ``cos_sin`` and ``plans``: per key that
        ``windows`` names for each layer (its window and KV group, model/kv_groups.py)."""
        t = int(hidden.shape[0])
        if not (0 < t <= cpu_kernels.PANEL_MAX_ROWS and hidden.dtype == torch.float32
                and hidden.is_contiguous() and hidden.shape[1] == self._hidden):
            return None
        for plan in plans.values():
            d = plan.decode
            if plan.prefill is not None or d is None or d.token_idx is not None:
                return None
        hd = self._head_dim
        rope = {}
        for w, (cos, sin) in cos_sin.items():
            cos, sin = cos.reshape(t, hd), sin.reshape(t, hd)
            if not (cos.is_contiguous() and sin.is_contiguous() and cos.dtype == torch.float32):
                return None
            rope[w] = (cos.data_ptr(), sin.data_ptr())
        for k, v in kv_caches:
            if (not cpu_kernels.kv_store_layout_ok(k, v)
                    or k.shape[2:] != (self._kv_heads, hd)):
                return None
        slots = {w: p.slot_mapping for w, p in plans.items()}
        if not all(s.dtype == torch.int64 and s.is_contiguous() for s in slots.values()):
            return None
        lib = self._lib
        with self._lock:
            buf = self._buffer(t)
            h, qkv, q, o, gu, ab, mlp, xb = (buf[k] for k in ("h", "qkv", "q", "o", "gu", "act",
                                                               "mlp", "x"))
            residual, x = hidden, None
            out = torch.empty_like(hidden)
            for i, (layer, (k_cache, v_cache)) in enumerate(zip(self._layers, kv_caches)):
                w = windows[i]
                n_in, n_post_attn, n_pre_ffw, n_post_ffw = layer.norms
                self._norm(residual if x is None else x, None if x is None else residual, n_in, h)
                self._linear(i, 0, h, qkv)
                cos, sin = rope[w]
                rc = lib.xllm_qk_norm_rope_store_f32(
                    qkv.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                    slots[w].data_ptr(), layer.q_norm.data_ptr(), layer.k_norm.data_ptr(),
                    layer.qk_eps, cos, sin, t, self._heads, self._kv_heads, hd)
                if rc != 0:
                    raise RuntimeError(f"q/k norm + RoPE kernel failed (code {rc})")
                qs = q if layer.q_scale is None else q * layer.q_scale
                a = attention.attend(qs, k_cache, v_cache, plans[w])
                self._linear(i, 1, a.reshape(t, self._q), o)
                self._norm(o, None, n_post_attn, h)
                self._norm(h, residual, n_pre_ffw, o)
                g_u = gu[:t * 2 * layer.inter].view(t, 2 * layer.inter)
                self._linear(i, 2, o, g_u)
                act = cpu_kernels.silu_and_mul(g_u, gelu=True,
                                               out=ab[:t * layer.inter].view(t, layer.inter))
                self._linear(i, 3, act, mlp)
                x = self._norm(mlp, None, n_post_ffw, out if i == len(self._layers) - 1 else xb)
            return out, residual
