"""Int8 panels: weights that are exactly a per-32 scale times small integers (GGUF Q8_0 and
Q5_0, dequantized) held as int8, with the same sums as float32 panels, bit for bit."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from xllm_py.model import cpu_kernels
from xllm_py.model.int8_panels import PanelEmbedding, int8_blocks, pack_int8_panels, unpack_rows
from xllm_py.model.packed import PackedLinear, pack_linears

pytestmark = pytest.mark.skipif(not cpu_kernels.linear_available(),
                                reason="int8 panels need the native kernels")
gguf = pytest.importorskip("gguf")


def _gguf_weight(n: int, k: int, qtype: str, seed: int = 0) -> torch.Tensor:
    """A float32 weight as a GGUF file of that type would give it back: quantized with the
    gguf package, then dequantized."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    rng = np.random.default_rng(seed)
    w = rng.normal(0, 0.05, (n, k)).astype(np.float32)
    t = getattr(GGMLQuantizationType, qtype)
    return torch.from_numpy(np.ascontiguousarray(dequantize(quantize(w, t), t)))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q5_0"])
def test_gguf_weights_are_found_exactly(qtype):
    w = _gguf_weight(96, 640, qtype)
    q, s = int8_blocks(w)
    assert torch.equal((q.float().view(96, -1, 32) * s[..., None]).view(96, 640), w)


def test_other_weights_are_not():
    assert int8_blocks(torch.randn(64, 640)) is None
    assert int8_blocks(_gguf_weight(64, 640, "Q4_1")) is None  # an offset per block
    assert int8_blocks(torch.randn(64, 40)) is None  # not whole blocks


def test_mixed_rows_and_zero_blocks():
    w = torch.cat([_gguf_weight(32, 256, "Q8_0", 1), _gguf_weight(48, 256, "Q5_0", 2)])
    w[3, 32:64] = 0.0
    q, s = int8_blocks(w)
    assert torch.equal((q.float().view(80, -1, 32) * s[..., None]).view(80, 256), w)


@pytest.mark.parametrize("rows", [1, 2, 7, 32, 96, 97, 250])
def test_int8_panels_equal_float32_panels(rows):
    w = _gguf_weight(1000, 640, "Q8_0", 3)
    lin = nn.Linear(640, 1000)
    lin.weight.data = w
    x = torch.randn(rows, 640)
    f32 = PackedLinear(lin)
    i8 = PackedLinear(lin, int8=int8_blocks(w))
    assert "panels-int8" in repr(i8)
    # the decode kernel's sums up to PANEL_MAX_ROWS rows, linear_large's past that
    assert torch.equal(i8(x), f32(x))
    with cpu_kernels.disabled():  # the torch fallback reads the same values
        assert torch.allclose(i8(x), lin(x), atol=1e-4)


def test_pack_linears_takes_int8_and_the_embedding_reads_the_head():
    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = type("C", (), {"tie_word_embeddings": True})()
            self.model = nn.Module()
            self.model.embed_tokens = nn.Embedding(300, 64)
            self.lm_head = nn.Linear(64, 300, bias=False)
            self.lm_head.weight = self.model.embed_tokens.weight
            self.proj = nn.Linear(64, 64)

    m = Tiny()
    with torch.no_grad():
        m.model.embed_tokens.weight.copy_(_gguf_weight(300, 64, "Q8_0", 4))
    table = m.model.embed_tokens.weight.detach().clone()
    x = torch.randn(5, 64)
    want_head, want_proj = m.lm_head(x), m.proj(x)
    assert pack_linears(m) == 2
    assert isinstance(m.model.embed_tokens, PanelEmbedding)
    ids = torch.tensor([[0, 299, 17], [5, 5, 128]])
    assert torch.equal(m.model.embed_tokens(ids), table[ids])
    assert torch.allclose(m.lm_head(x), want_head, atol=1e-5)
    assert torch.allclose(m.proj(x), want_proj, atol=1e-5)  # random: float32 panels
    assert "panels-int8" not in repr(m.proj)


def test_unpack_rows_is_the_weight():
    w = _gguf_weight(40, 96, "Q5_0", 5)
    panels, scales = pack_int8_panels(*int8_blocks(w))
    rows = torch.tensor([0, 15, 16, 39])
    assert torch.equal(unpack_rows(panels, scales, rows), w[rows])
