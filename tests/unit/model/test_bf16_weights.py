"""bfloat16 linear weights on CPU (xllm_py/model/packed.py, csrc panel kernels): bfloat16
panels give the float32 panels' sums bit for bit on bfloat16-valued weights, ``pack_linears``
chooses the panels' dtype as documented, and a model built with bfloat16 weights decodes
with the same logits whichever panels hold them (the fused step and the per-op path)."""
from __future__ import annotations

import logging
import random

import pytest
import torch
from safetensors import safe_open

from xllm_py.engine.model_runner import ModelRunner
from xllm_py.engine.scheduler import ScheduledSeq
from xllm_py.model import cpu_kernels, fused_decode
from xllm_py.model.attention import allocate_kv_caches
from xllm_py.model.loader import load_model
from xllm_py.model.packed import PackedLinear, is_bfloat16_valued, pack_linears
from xllm_py.model.tiny import build_model_dir

needs_kernels = pytest.mark.skipif(not cpu_kernels.linear_available(),
                                   reason="no native linear kernels "
                                          f"({cpu_kernels.unavailable_reason() or 'no AVX2/FMA'})")

BLOCK_SIZE = 4


def _bf16_valued(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16).float()


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 6, 7, 32, 96, 97, 300])
@pytest.mark.parametrize("out_features,in_features", [(3072, 512), (512, 1536), (40, 70), (17, 3)])
def test_bf16_panels_give_the_float32_sums(rows, out_features, in_features):
    """Decode sizes (linear_panels, <= 96 rows) and prefill sizes (linear_large); partial
    panels (N % 16), K chunks with a remainder, odd K."""
    w = _bf16_valued(out_features, in_features, seed=rows)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(out_features, generator=torch.Generator().manual_seed(2))
    fn = cpu_kernels.linear_panels if rows <= cpu_kernels.PANEL_MAX_ROWS else cpu_kernels.linear_large
    p32 = cpu_kernels.pack_panels(w)
    p16 = cpu_kernels.pack_panels(w, torch.bfloat16)
    assert p16.dtype == torch.bfloat16 and p16.nbytes * 2 == p32.nbytes
    for b in (bias, None):
        y32, y16 = fn(x, p32, out_features, b), fn(x, p16, out_features, b)
        assert y16 is not None and torch.equal(y32, y16)
        ref = torch.nn.functional.linear(x.double(), w.double(),
                                         None if b is None else b.double())
        # (every row sums k in order, one chain: outputs near 80 carry ~1e-4 of rounding)
        assert torch.allclose(y16.double(), ref, rtol=2e-6, atol=1e-4)


@needs_kernels
def test_packed_linear_falls_back_from_bf16_panels():
    """When the kernels decline, the torch path reads the bfloat16 panels in place."""
    lin = torch.nn.Linear(70, 40)
    with torch.no_grad():
        lin.weight.copy_(_bf16_valued(40, 70, seed=3))
    packed = PackedLinear(lin, weight_dtype=torch.bfloat16)
    x = torch.randn(5, 70)
    native = packed(x)
    with cpu_kernels.disabled():
        fallback = packed(x)
    assert torch.allclose(native, fallback, rtol=0, atol=1e-5)
    assert torch.allclose(native, lin(x), rtol=0, atol=1e-5)


def _panel_dtypes(model) -> set[torch.dtype]:
    return {m._panels.dtype for m in model.modules() if isinstance(m, PackedLinear)}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """The same random model stored in float32 and in bfloat16."""
    shape = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                 intermediate_size=96, seed=5)
    return {dtype: build_model_dir(tmp_path_factory.mktemp(dtype), dtype=dtype, **shape)
            for dtype in ("float32", "bfloat16")}


def test_tiny_builder_writes_bfloat16(model_dirs):
    with safe_open(str(model_dirs["bfloat16"] / "model.safetensors"), framework="pt") as f:
        dtypes = {f.get_slice(name).get_dtype() for name in f.keys()}
    assert dtypes == {"BF16"}
    with safe_open(str(model_dirs["float32"] / "model.safetensors"), framework="pt") as f:
        assert {f.get_slice(name).get_dtype() for name in f.keys()} == {"F32"}
    with pytest.raises(ValueError, match="dtype"):
        build_model_dir(model_dirs["float32"].parent / "bad", dtype="float16")


@needs_kernels
def test_pack_linears_chooses_the_panel_dtype(model_dirs, caplog):
    bf16_model, _ = load_model(str(model_dirs["bfloat16"]))
    assert all(is_bfloat16_valued(p) for p in bf16_model.parameters())
    assert pack_linears(bf16_model) > 0  # auto: exact in bfloat16
    assert _panel_dtypes(bf16_model) == {torch.bfloat16}

    f32_model, _ = load_model(str(model_dirs["float32"]))
    pack_linears(f32_model)  # auto: float32 values stay float32
    assert _panel_dtypes(f32_model) == {torch.float32}

    forced, _ = load_model(str(model_dirs["bfloat16"]))
    pack_linears(forced, weight_dtype="float32")
    assert _panel_dtypes(forced) == {torch.float32}

    rounded, _ = load_model(str(model_dirs["float32"]))
    with caplog.at_level(logging.WARNING, logger="xllm_py.model.packed"):
        count = pack_linears(rounded, weight_dtype="bfloat16")
    assert _panel_dtypes(rounded) == {torch.bfloat16}
    assert f"{count} of {count} linear weights rounded to bfloat16" in caplog.text

    with pytest.raises(ValueError, match="weight_dtype"):
        pack_linears(f32_model, weight_dtype="float16")


def _decode_logits(model, cfg, lengths: list[int], steps: int) -> list[torch.Tensor]:
    """Prefill prompts of these lengths in one step, then greedy decode steps of the whole
    batch; every step's logits."""
    caches = allocate_kv_caches(cfg.num_layers, 64, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
    runner = ModelRunner(model, caches, BLOCK_SIZE)
    rng = random.Random(7)
    free = list(range(1, 64))
    seqs = []
    for i, n in enumerate(lengths):
        table = [free.pop() for _ in range((n + steps) // BLOCK_SIZE + 1)]
        seqs.append(ScheduledSeq(f"r{i}", [rng.randrange(3, cfg.vocab_size) for _ in range(n)],
                                 0, table, True))
    out = []
    with torch.inference_mode():
        for _ in range(steps + 1):
            logits = runner.execute(seqs)
            out.append(logits)
            seqs = [ScheduledSeq(s.request_id, [t], s.start_pos + len(s.token_ids),
                                 s.block_table, True)
                    for s, t in zip(seqs, logits.argmax(-1).tolist())]
    return out


@needs_kernels
@pytest.mark.parametrize("lengths", [[9], [3, 5, 8, 13, 21, 40, 50]], ids=["one", "batch"])
def test_bf16_panels_decode_like_float32_panels(model_dirs, lengths):
    """The prefill (the second case has > 96 tokens: linear_large) and the fused decode
    steps give the same logits, bit for bit, from bfloat16 and from float32 panels."""
    results = {}
    for weight_dtype in ("bfloat16", "float32"):
        model, cfg = load_model(str(model_dirs["bfloat16"]))
        pack_linears(model, weight_dtype=weight_dtype)
        assert fused_decode.FusedDecoder.build(model) is not None
        results[weight_dtype] = _decode_logits(model, cfg, lengths, steps=4)
    for step, (a, b) in enumerate(zip(results["bfloat16"], results["float32"])):
        assert torch.equal(a, b), f"step {step}"
