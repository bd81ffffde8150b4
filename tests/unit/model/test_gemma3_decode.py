"""Gemma3DecodeRunner (gemma3_decode.py): decode steps of a packed Gemma 3 model give the
per-op path's logits and KV caches bit for bit, across sliding windows, batches and a
q scale off head_dim ** -0.5; prefill and mixed steps keep the per-op path."""
from __future__ import annotations

import copy
import pathlib

import pytest
import torch

from xllm_py.model import cpu_kernels
from xllm_py.model.attention import AttentionMetadata, allocate_kv_caches, build_positions
from xllm_py.model.gemma3_decode import Gemma3DecodeRunner
from xllm_py.model.loader import load_model
from xllm_py.model.packed import pack_linears
from xllm_py.model.tiny import build_tokenizer_files

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.integration,  # builds and loads a model
              pytest.mark.skipif(not cpu_kernels.linear_available(),
                                 reason="the runner needs the native kernels")]

BLOCK = 4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.Gemma3TextConfig(
        hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=512, initializer_range=0.05, head_dim=16,
        sliding_window=6, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        query_pre_attn_scalar=24, tie_word_embeddings=True, eos_token_id=None,
        bos_token_id=None, pad_token_id=None,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    path = tmp_path_factory.mktemp("gemma3")
    hf.save_pretrained(path)
    build_tokenizer_files(pathlib.Path(path))
    model, config = load_model(path)
    pack_linears(model)
    per_op = copy.deepcopy(model)
    per_op.fused_decode = False  # the per-op path
    return model, per_op, config


def _run(model, config, steps):
    """Prefill three prompts, then decode ``steps`` steps of all three; logits per step."""
    caches = allocate_kv_caches(config.num_layers, 64, BLOCK, config.num_kv_heads,
                                config.head_dim)
    tables = [list(range(1 + 12 * i, 13 + 12 * i)) for i in range(3)]
    g = torch.Generator().manual_seed(1)
    lens = [3, 9, 17]
    out = []
    with torch.inference_mode():
        seqs = [(0, n, tables[i]) for i, n in enumerate(lens)]
        ids = torch.randint(0, config.vocab_size, (sum(lens),), generator=g)
        out.append(model.forward_logits(ids, build_positions(seqs),
                                        AttentionMetadata.build(seqs, BLOCK), caches))
        for s in range(steps):
            seqs = [(n + s, 1, tables[i]) for i, n in enumerate(lens)]
            ids = torch.randint(0, config.vocab_size, (3,), generator=g)
            out.append(model.forward_logits(ids, build_positions(seqs),
                                            AttentionMetadata.build(seqs, BLOCK), caches))
            one = [(lens[0] + s + 1, 1, tables[0])]  # batch 1 as well (its own position)
            out.append(model.forward_logits(ids[:1], build_positions(one),
                                            AttentionMetadata.build(one, BLOCK), caches))
            lens[0] += 1
    return out, caches


def test_runner_is_built_for_the_packed_gemma(models):
    model, _, _ = models
    assert isinstance(model._decode_runner(), Gemma3DecodeRunner)


def test_decode_steps_equal_the_per_op_path(models):
    model, per_op, config = models
    calls = []
    real = Gemma3DecodeRunner.run

    def counted(self, *a, **k):
        r = real(self, *a, **k)
        calls.append(r is not None)
        return r

    Gemma3DecodeRunner.run = counted
    try:
        got, got_caches = _run(model, config, 8)
    finally:
        Gemma3DecodeRunner.run = real
    want, want_caches = _run(per_op, config, 8)
    assert calls == [False] + [True] * 16  # the prefill kept the per-op path
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    for (k1, v1), (k2, v2) in zip(got_caches, want_caches):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
