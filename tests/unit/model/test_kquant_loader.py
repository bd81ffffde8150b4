"""GGUF K-quant blocks from a converted model directory to the packed model: the converter's
blocks file (gguf_convert.write_blocks), the loader attaching them (whole weights of one
type, fused q/k/v and gate/up included) and the packed model's logits equal to the same
model with float32 panels."""
from __future__ import annotations

import pathlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from xllm_py.model import cpu_kernels
from xllm_py.model.attention import AttentionMetadata, allocate_kv_caches, build_positions
from xllm_py.model.gguf_convert import BLOCKS_FILE, write_blocks
from xllm_py.model.loader import load_model
from xllm_py.model.packed import pack_linears
from xllm_py.model.tiny import build_model_dir

pytestmark = [pytest.mark.integration,  # builds and loads a model
              pytest.mark.skipif(not cpu_kernels.linear_available(),
                                 reason="K-quant panels need the native kernels")]
gguf = pytest.importorskip("gguf")

from tests.unit.model.test_kquant_panels import _gguf_dequantize, _random_blocks  # noqa: E402

# GGUF name -> (type, rows, columns): qwen3 with hidden 256, 4 heads of 64, intermediate 512
TENSORS = {
    "blk.0.attn_output.weight": ("Q4_K", 256, 256),
    "blk.0.ffn_down.weight": ("Q6_K", 256, 512),
    "blk.0.ffn_gate.weight": ("Q4_K", 512, 256),
    "blk.0.ffn_up.weight": ("Q4_K", 512, 256),
    "blk.1.ffn_gate.weight": ("Q4_K", 512, 256),  # with a Q6_K up: not one type
    "blk.1.ffn_up.weight": ("Q6_K", 512, 256),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> pathlib.Path:
    from xllm_py.model.gguf_convert import hf_tensor_name

    path = build_model_dir(tmp_path_factory.mktemp("kq") / "m", family="qwen3", hidden_size=256,
                           num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=512,
                           seed=3)
    tensors = load_file(str(path / "model.safetensors"))
    fake = []
    for i, (name, (qtype, n, k)) in enumerate(TENSORS.items()):
        raw = _random_blocks(qtype, n, k, seed=i)
        hf = hf_tensor_name(name)
        assert tensors[hf].shape == (n, k)
        tensors[hf] = _gguf_dequantize(qtype, raw)
        if name == "blk.0.attn_output.weight":
            tensors[hf] *= 0.5  # the checkpoint's weight is not its blocks' values
        fake.append(SimpleNamespace(name=name, tensor_type=getattr(gguf.GGMLQuantizationType, qtype),
                                    shape=[k, n], data=raw))
    fake.append(SimpleNamespace(name="blk.0.attn_norm.weight",  # not a K-quant: left out
                                tensor_type=gguf.GGMLQuantizationType.F32, shape=[256],
                                data=np.zeros(256, np.float32)))
    save_file(tensors, str(path / "model.safetensors"))
    assert write_blocks(SimpleNamespace(tensors=fake), path, "test.gguf") == len(TENSORS)
    return path


def _logits(model, cfg, ids: list[int]) -> torch.Tensor:
    caches = allocate_kv_caches(cfg.num_layers, 40, 4, cfg.num_kv_heads, cfg.head_dim)
    seqs = [(0, len(ids), list(range(1, 1 + (len(ids) + 3) // 4)))]
    with torch.inference_mode():
        return model.forward_logits(torch.tensor(ids), build_positions(seqs),
                                    AttentionMetadata.build(seqs, 4), caches)


def test_blocks_file_is_beside_the_weights(model_dir):
    assert (model_dir / BLOCKS_FILE).is_file()
    assert not list((model_dir / BLOCKS_FILE).parent.glob("model*"))
    assert sorted(p.name for p in model_dir.glob("*.safetensors")) == ["model.safetensors"]


def test_loader_attaches_whole_weights_of_one_type(model_dir):
    model, _ = load_model(model_dir)
    l0, l1 = model.model.layers
    assert l0.self_attn.o_proj.gguf_blocks[0] == "Q4_K"
    assert l0.mlp.down_proj.gguf_blocks[0] == "Q6_K"
    assert l0.mlp.gate_up_proj.gguf_blocks[1].shape[0] == 1024  # gate and up rows
    assert not hasattr(l1.mlp.gate_up_proj, "gguf_blocks")  # Q4_K + Q6_K
    assert not hasattr(l0.self_attn.qkv_proj, "gguf_blocks")


def test_packed_model_keeps_them_quantized_with_the_same_logits(model_dir):
    float_model, cfg = load_model(model_dir)
    pack_linears(float_model, weight_dtype="float32")
    model, _ = load_model(model_dir)
    pack_linears(model)
    l0 = model.model.layers[0]
    # o_proj's float weight is not its blocks' values: it keeps float32 panels
    assert l0.self_attn.o_proj._kq is None
    assert l0.mlp.down_proj._kq.qtype == "Q6_K"
    assert l0.mlp.gate_up_proj._kq.qtype == "Q4_K"
    for ids in (list(range(5, 40)), [i % 200 for i in range(130)]):  # decode-size, prompt-size
        assert torch.equal(_logits(model, cfg, ids), _logits(float_model, cfg, ids))
