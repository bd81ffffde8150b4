"""Native CPU kernels and packed linears against the torch reference paths."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from xllm_py.model import cpu_kernels, kernel_build
from xllm_py.model.attention import (AttentionMetadata, attend, decode_attention_torch,
                                     plan_attention)
from xllm_py.model.layers import GatedMLP, RMSNorm, RotaryEmbedding
from xllm_py.model.int8_panels import pack_int8_panels
from xllm_py.model.packed import PackedLinear, pack_linears

needs_kernels = pytest.mark.skipif(not cpu_kernels.available(),
                                   reason=f"CPU kernels: {cpu_kernels.unavailable_reason()}")


def _random_tables(rng: torch.Generator, seq_lens: list[int], bs: int, num_blocks: int):
    need = [(n + bs - 1) // bs for n in seq_lens]
    perm = torch.randperm(num_blocks - 1, generator=rng) + 1  # block 0 is padding
    tables, used = [], 0
    for k in need:
        tables.append(perm[used:used + k].tolist())
        used += k
    return tables


@needs_kernels
@pytest.mark.parametrize("h,kvh,hd,bs", [(8, 4, 64, 16), (4, 4, 32, 4), (16, 2, 128, 8),
                                         (6, 2, 64, 1),
                                         # head_dim off the 32-wide (80) and 8-wide (20) paths
                                         (4, 2, 80, 16), (2, 1, 20, 8)])
def test_decode_attention_matches_sdpa(h: int, kvh: int, hd: int, bs: int) -> None:
    rng = torch.Generator().manual_seed(h * 100 + hd + bs)
    seq_lens = [1, 2, bs, bs + 1, 3 * bs - 1, 5 * bs, 37]
    num_blocks = 2 + sum((n + bs - 1) // bs for n in seq_lens)
    k_cache = torch.randn(num_blocks, bs, kvh, hd, generator=rng)
    v_cache = torch.randn(num_blocks, bs, kvh, hd, generator=rng)
    tables = _random_tables(rng, seq_lens, bs, num_blocks)
    md = AttentionMetadata.build([(n - 1, 1, t) for n, t in zip(seq_lens, tables)], bs)
    plan = plan_attention(md, bs)
    q = torch.randn(len(seq_lens), h, hd, generator=rng)
    want = decode_attention_torch(q, k_cache, v_cache, plan.decode)
    got = cpu_kernels.paged_decode_attention(q, k_cache, v_cache, plan.decode.block_tables,
                                             plan.decode.seq_lens, hd ** -0.5)
    assert (got - want).abs().max().item() < 2e-5


@needs_kernels
def test_decode_attention_per_layer_views_of_one_pool() -> None:
    """The engine's caches are [2, L, N, bs, kvh, hd] views: block stride, not contiguous."""
    rng = torch.Generator().manual_seed(3)
    pool = torch.randn(2, 3, 20, 4, 2, 16, generator=rng)
    k_cache, v_cache = pool[0, 1], pool[1, 1]
    md = AttentionMetadata.build([(6, 1, [3, 9]), (0, 1, [17])], 4)
    plan = plan_attention(md, 4)
    q = torch.randn(2, 4, 16, generator=rng)
    want = decode_attention_torch(q, k_cache, v_cache, plan.decode)
    got = cpu_kernels.paged_decode_attention(q, k_cache, v_cache, plan.decode.block_tables,
                                             plan.decode.seq_lens, 0.25)
    assert (got - want).abs().max().item() < 2e-5


@needs_kernels
def test_prefill_attention_matches_padded_sdpa() -> None:
    """Prefill tokens through the kernel (each a decode query over its causal prefix) equal
    the gather + masked SDPA reference: chunks after a cached prefix, a whole prompt and a
    decode token in one batch, blocks out of order."""
    rng = torch.Generator().manual_seed(11)
    bs, h, kvh, hd = 4, 8, 2, 32
    k_cache = torch.randn(40, bs, kvh, hd, generator=rng)
    v_cache = torch.randn(40, bs, kvh, hd, generator=rng)
    seqs = [(5, 7, [31, 2, 17]), (0, 9, [8, 22, 5]), (12, 1, [1, 3, 9, 30]), (0, 1, [14])]
    plan = plan_attention(AttentionMetadata.build(seqs, bs), bs)
    q = torch.randn(sum(n for _, n, _ in seqs), h, hd, generator=rng)
    assert cpu_kernels.decode_attention_supported(q, k_cache, v_cache)  # the kernel runs
    got = attend(q, k_cache, v_cache, plan)
    with cpu_kernels.disabled():
        want = attend(q, k_cache, v_cache, plan)
    assert (got - want).abs().max().item() < 2e-5


@needs_kernels
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_torch(with_residual: bool) -> None:
    rng = torch.Generator().manual_seed(1)
    norm = RMSNorm(96, eps=1e-5)
    norm.weight.data = torch.randn(96, generator=rng)
    x = torch.randn(70, 96, generator=rng) * 3  # 70 rows: the threaded branch too
    res = torch.randn(70, 96, generator=rng)
    res_ref = res.clone()
    got = cpu_kernels.rms_norm(x, norm.weight, 1e-5, res if with_residual else None)
    base = (res_ref + x) if with_residual else x
    want = F.rms_norm(base, (96,), norm.weight, 1e-5)
    assert (got - want).abs().max().item() < 1e-5
    if with_residual:
        assert torch.equal(res, res_ref + x)  # the stream was updated in place
    else:
        assert torch.equal(res, res_ref)


@needs_kernels
@pytest.mark.parametrize("qk_norm", [True, False])
def test_qk_norm_rope_store_matches_torch(qk_norm: bool) -> None:
    rng = torch.Generator().manual_seed(2)
    h, kvh, hd, bs, t = 8, 2, 64, 4, 19
    qkv = torch.randn(t, (h + 2 * kvh) * hd, generator=rng)
    rope = RotaryEmbedding(hd, 10000.0, 256)
    positions = torch.randint(0, 200, (t,), generator=rng)
    cos, sin = rope.cos_sin(positions, 256, torch.float32)
    qn, kn = RMSNorm(hd, 1e-6), RMSNorm(hd, 1e-6)
    qn.weight.data = torch.randn(hd, generator=rng)
    kn.weight.data = torch.randn(hd, generator=rng)
    pool = torch.zeros(2, 10, bs, kvh, hd)
    slots = torch.randperm(40, generator=rng)[:t]
    q = cpu_kernels.qk_norm_rope_store(qkv, h, kvh, hd, qn.weight if qk_norm else None,
                                       kn.weight if qk_norm else None, 1e-6, cos, sin,
                                       pool[0], pool[1], slots)
    rq, rk, rv = qkv.split([h * hd, kvh * hd, kvh * hd], dim=-1)
    rq, rk, rv = rq.reshape(t, h, hd), rk.reshape(t, kvh, hd), rv.reshape(t, kvh, hd)
    if qk_norm:
        rq, rk = qn(rq), kn(rk)
    rq, rk = RotaryEmbedding.apply(rq, rk, (cos, sin))
    assert (q - rq).abs().max().item() < 1e-5
    flat_k, flat_v = pool[0].view(-1, kvh, hd), pool[1].view(-1, kvh, hd)
    assert (flat_k[slots] - rk).abs().max().item() < 1e-5
    assert torch.equal(flat_v[slots], rv)
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[slots] = False
    assert not flat_k[untouched].any() and not flat_v[untouched].any()


@needs_kernels
def test_silu_and_mul_matches_torch() -> None:
    rng = torch.Generator().manual_seed(4)
    x = torch.randn(33, 2 * 200, generator=rng) * 20  # large magnitudes: exp clamping
    got = cpu_kernels.silu_and_mul(x)
    gate, up = x.split(200, dim=-1)
    want = F.silu(gate) * up
    assert ((got - want).abs() / (want.abs() + 1)).max().item() < 1e-5


@needs_kernels
def test_gelu_tanh_and_mul_matches_torch() -> None:
    """GeGLU (Gemma): torch's gelu_pytorch_tanh within float32 rounding, into a given
    output too; large magnitudes of both signs (exp clamping, tanh saturating)."""
    rng = torch.Generator().manual_seed(5)
    x = torch.randn(33, 2 * 200, generator=rng) * 20
    gate, up = x.split(200, dim=-1)
    want = F.gelu(gate, approximate="tanh") * up
    got = cpu_kernels.silu_and_mul(x, gelu=True)
    assert ((got - want).abs() / (want.abs() + 1)).max().item() < 1e-5
    out = torch.full((33, 200), float("nan"))
    assert cpu_kernels.silu_and_mul(x, gelu=True, out=out) is out
    assert torch.equal(out, got)


def test_kernels_decline_what_they_do_not_handle() -> None:
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    assert cpu_kernels.rms_norm(x, torch.ones(8, dtype=torch.bfloat16), 1e-6) is None
    assert cpu_kernels.silu_and_mul(torch.randn(4, 8).t()) is None  # not contiguous
    q = torch.randn(2, 4, 8)
    half = torch.randn(3, 4, 2, 8).half()
    assert not cpu_kernels.decode_attention_supported(q, half, half)
    # blocks that are not contiguous (here: kvh and hd swapped in memory) take the torch path
    odd = torch.randn(3, 4, 8, 2).transpose(2, 3)
    assert not cpu_kernels.decode_attention_supported(q, odd, odd)
    qkv = torch.randn(5, (4 + 2 * 2) * 8)
    cos = sin = torch.ones(5, 8)
    assert cpu_kernels.qk_norm_rope_store(qkv, 4, 2, 8, None, None, 1e-6, cos, sin, odd, odd,
                                          torch.arange(5)) is None


@pytest.mark.integration
def test_disabled_by_environment() -> None:
    code = ("from xllm_py.model import cpu_kernels as c; "
            "print(c.available(), c.unavailable_reason())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "XLLM_CPU_KERNELS": "0"}, check=True).stdout
    assert out.strip() == "False disabled by XLLM_CPU_KERNELS"


def test_packed_linear_matches_linear() -> None:
    rng = torch.Generator().manual_seed(5)
    lin = torch.nn.Linear(48, 80, bias=True)
    lin.weight.data = torch.randn(80, 48, generator=rng)
    lin.bias.data = torch.randn(80, generator=rng)
    packed = PackedLinear(lin)
    if cpu_kernels.linear_available():  # one layout: panels, no oneDNN copy
        assert packed._packed is None and packed._panels is not None
    # panels up to 96 rows, the large-M kernel past that (oneDNN without the kernels)
    for rows in (1, 7, 32, 96, 97, 300, 2048):
        x = torch.randn(rows, 48, generator=rng)
        with torch.inference_mode():
            assert (packed(x) - lin(x)).abs().max().item() < 1e-4
    x = torch.randn(2, 60, 48, generator=rng)  # leading dims, more than 96 rows in all
    with torch.inference_mode():
        assert (packed(x) - lin(x)).abs().max().item() < 1e-4


def test_packed_linear_without_kernels_keeps_onednn() -> None:
    lin = torch.nn.Linear(40, 24)
    with cpu_kernels.disabled():
        packed = PackedLinear(lin)
        assert packed._panels is None and packed._packed is not None
        for rows in (3, 200):
            x = torch.randn(rows, 40)
            with torch.inference_mode():
                assert (packed(x) - lin(x)).abs().max().item() < 1e-4


@needs_kernels
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_falls_back_to_torch_when_kernels_decline(
        with_bias: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = torch.Generator().manual_seed(9)
    lin = torch.nn.Linear(70, 37, bias=with_bias)  # a partial last panel, K % 8 != 0
    packed = PackedLinear(lin)
    xs = [torch.randn(rows, 70, generator=rng) for rows in (1, 32, 96, 97, 300)]
    with torch.inference_mode():
        want = [lin(x) for x in xs]
        # the native calls decline at run time (as on an allocation failure)
        monkeypatch.setattr(cpu_kernels, "linear_panels", lambda *a: None)
        monkeypatch.setattr(cpu_kernels, "linear_large", lambda *a: None)
        for x, w in zip(xs, want):
            got = packed(x)
            assert got.shape == w.shape and got.is_contiguous()
            assert (got - w).abs().max().item() < 1e-4
        monkeypatch.undo()
        with cpu_kernels.disabled():  # the library itself gone: same path
            for x, w in zip(xs, want):
                assert (packed(x) - w).abs().max().item() < 1e-4


def test_pack_linears_replaces_every_linear_and_keeps_outputs() -> None:
    torch.manual_seed(6)
    mlp = GatedMLP(32, 64)
    x = torch.randn(5, 32)
    with torch.inference_mode():
        want = mlp(x)
        assert pack_linears(mlp) == 2
        got = mlp(x)
    assert not any(isinstance(m, torch.nn.Linear) for m in mlp.modules())
    assert (got - want).abs().max().item() < 1e-5
    assert pack_linears(GatedMLP(8, 8).to(torch.bfloat16)) == 0  # float32 only


@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.integration
def test_engine_packs_weights_unless_told_not_to(pack: bool) -> None:
    from xllm_py.config import CacheConfig, EngineConfig
    from xllm_py.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model="tiny", pack_weights=pack,
                                    cache=CacheConfig(num_blocks=16)))
    down = engine.model.model.layers[0].mlp.down_proj
    assert isinstance(down, PackedLinear if pack else torch.nn.Linear)


@needs_kernels
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_panels_matches_linear(with_bias: bool) -> None:
    rng = torch.Generator().manual_seed(7)
    for k in (70, 300):  # one k-chunk; three, the last partial
        w = torch.randn(37, k, generator=rng)  # 37: a partial last panel
        b = torch.randn(37, generator=rng) if with_bias else None
        panels = cpu_kernels.pack_panels(w)
        assert panels.shape == (3, k, 16)
        # every tail of 6 (a partial last tile runs only its rows), 19, 20, 32, the most
        for rows in list(range(1, 14)) + [19, 20, 32, cpu_kernels.PANEL_MAX_ROWS]:
            x = torch.randn(rows, k, generator=rng)
            got = cpu_kernels.linear_panels(x, panels, 37, b)
            assert got.shape == (rows, 37)
            assert (got - F.linear(x, w, b)).abs().max().item() < 1e-4
    w = torch.randn(37, 70, generator=rng)
    b = torch.randn(37, generator=rng) if with_bias else None
    panels = cpu_kernels.pack_panels(w)
    too_many = torch.randn(cpu_kernels.PANEL_MAX_ROWS + 1, 70)
    assert cpu_kernels.linear_panels(too_many, panels, 37, b) is None


@needs_kernels
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_large_matches_linear(with_bias: bool) -> None:
    rng = torch.Generator().manual_seed(8)
    # K: < 8 columns left after the 8-wide packing; two chunks of 256, the last partial;
    # three, K odd
    for n, k in ((37, 70), (48, 300), (37, 517)):  # 37: a partial last panel
        w = torch.randn(n, k, generator=rng)
        b = torch.randn(n, generator=rng) if with_bias else None
        panels = cpu_kernels.pack_panels(w)
        # around the threshold, partial 6-row tiles (129-133), several 96-row blocks per
        # thread (1000); small counts work too
        for rows in (1, 5, 97, 100, 128, 129, 130, 131, 132, 133, 300, 1000):
            x = torch.randn(rows, k, generator=rng)
            got = cpu_kernels.linear_large(x, panels, n, b)
            assert got.shape == (rows, n)
            assert (got - F.linear(x, w, b)).abs().max().item() < 1e-4


@needs_kernels
def test_linear_large_declines_what_it_does_not_handle() -> None:
    panels = cpu_kernels.pack_panels(torch.randn(20, 16))
    assert cpu_kernels.linear_large(torch.randn(16, 200).t(), panels, 20, None) is None
    assert cpu_kernels.linear_large(torch.randn(200, 16).double(), panels, 20, None) is None
    assert cpu_kernels.linear_large(torch.randn(4, 200, 16), panels, 20, None) is None
    with cpu_kernels.disabled():
        assert cpu_kernels.linear_large(torch.randn(200, 16), panels, 20, None) is None


both_isas = pytest.mark.skipif(
    not (cpu_kernels.linear_available()
         and kernel_build.choose_isa(None, kernel_build.cpu_flags()) == "avx512"),
    reason="needs a CPU with AVX-512 (to run both builds)")


def _each_isa(fn):
    """fn() under the AVX2 build and under the AVX-512 one: {isa: result}."""
    out = {}
    for isa in ("avx2", "avx512"):
        with cpu_kernels.built_for(isa):
            assert cpu_kernels.isa() == isa
            out[isa] = fn()
    return out


@both_isas
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_avx512_build_gives_the_avx2_floats(dtype: str) -> None:
    """The AVX-512 panel kernels (csrc/panels_avx512.c) run every output's fmas in the AVX2
    kernels' order, on the same widened weights: the same floats, bit for bit. Partial
    panels (N % 16), rows past whole tiles of either build (6 and 12), K of no round size
    (int8: multiples of 32 only); one row, decode batches and linear_large's prompt rows."""
    rng = torch.Generator().manual_seed(11)
    for n, k in ((37, 67), (101, 300), (16, 640), (5, 33)) if dtype != "int8" else (
            (37, 96), (101, 320), (9, 640)):
        w = torch.randn(n, k, generator=rng)
        b = torch.randn(n, generator=rng)
        if dtype == "int8":
            q = torch.randint(-127, 128, (n, k), generator=rng, dtype=torch.int8)
            s = torch.rand(n, k // 32, generator=rng) / 64
            panels, scales = pack_int8_panels(q, s)
        else:
            panels = cpu_kernels.pack_panels(w, getattr(torch, dtype))
        for rows in (1, 2, 5, 6, 7, 11, 12, 13, 25, 32, 96, 97, 131, 250):
            x = torch.randn(rows, k, generator=rng)

            def run() -> torch.Tensor:
                if dtype == "int8":
                    return cpu_kernels.linear_panels_int8(x, panels, scales, n, b)
                if rows <= cpu_kernels.PANEL_MAX_ROWS:
                    return cpu_kernels.linear_panels(x, panels, n, b)
                return cpu_kernels.linear_large(x, panels, n, b)

            got = _each_isa(run)
            assert got["avx2"] is not None and got["avx512"] is not None
            assert torch.equal(got["avx2"], got["avx512"]), (n, k, rows)
            want = _reference(x, panels, n, b, dtype, scales if dtype == "int8" else None)
            assert (got["avx512"] - want).abs().max().item() < 1e-3


def _reference(x: torch.Tensor, panels: torch.Tensor, n: int, b: torch.Tensor, dtype: str,
               scales: torch.Tensor | None) -> torch.Tensor:
    """The product in float64 from the panels' values."""
    p = panels.double() if scales is None else (
        panels.double().view(panels.shape[0], -1, 32, 16) * scales.double()[:, :, None]
    ).view(panels.shape)
    w = p.transpose(1, 2).reshape(-1, panels.shape[1])[:n]
    return (x.double() @ w.T + b.double()).float()



def test_isa_is_the_widest_the_cpu_has_unless_told() -> None:
    avx512 = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"}
    assert kernel_build.choose_isa(None, avx512) == "avx512"
    assert kernel_build.choose_isa("avx2", avx512) == "avx2"
    assert kernel_build.choose_isa(None, avx512 - {"avx512vl"}) == "avx2"
    assert kernel_build.choose_isa("avx512", {"avx2", "fma"}) == "avx2"  # its code would fault
    assert kernel_build.choose_isa(None, {"sse2"}) == ""
    assert {"-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl",
            "-mavx512dq"} <= set(kernel_build.compile_flags("avx512"))
    assert "-mavx512f" not in kernel_build.compile_flags("avx2")
    assert "-mavx2" in kernel_build.compile_flags("avx2")
    assert "-mavx2" not in kernel_build.compile_flags("")
