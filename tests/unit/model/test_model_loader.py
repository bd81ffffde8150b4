"""load_model on good (single file, sharded, tied) and bad model directories."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from xllm_py.model.attention import AttentionMetadata, allocate_kv_caches, build_positions
from xllm_py.model.loader import check_model_dir, load_model
from xllm_py.model.tiny import build_model_dir

pytestmark = pytest.mark.integration  # builds and loads models

SHAPE = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=48)


@pytest.fixture(scope="module")
def template_dir(tmp_path_factory) -> pathlib.Path:
    return build_model_dir(tmp_path_factory.mktemp("tpl") / "m", family="qwen3", seed=3, **SHAPE)


@pytest.fixture
def model_dir(template_dir, tmp_path) -> pathlib.Path:
    dst = tmp_path / "m"
    shutil.copytree(template_dir, dst)
    return dst


def _edit_weights(path: pathlib.Path, fn) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def _last_logits(model, cfg, ids: list[int]) -> torch.Tensor:
    caches = allocate_kv_caches(cfg.num_layers, 16, 4, cfg.num_kv_heads, cfg.head_dim)
    seqs = [(0, len(ids), list(range(1, 1 + (len(ids) + 3) // 4)))]
    with torch.inference_mode():
        h = model(torch.tensor(ids), build_positions(seqs), AttentionMetadata.build(seqs, 4), caches)
        return model.compute_logits(h[-1:])


def test_loads_values_exactly(model_dir):
    model, cfg = load_model(model_dir)
    tensors = load_file(str(model_dir / "model.safetensors"))
    assert cfg.architecture == "Qwen3ForCausalLM"
    assert cfg.tie_word_embeddings is True
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    attn = model.model.layers[1].self_attn
    q = tensors["model.layers.1.self_attn.q_proj.weight"]
    k = tensors["model.layers.1.self_attn.k_proj.weight"]
    v = tensors["model.layers.1.self_attn.v_proj.weight"]
    assert torch.equal(attn.qkv_proj.weight, torch.cat([q, k, v]))
    up = tensors["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(model.model.layers[0].mlp.gate_up_proj.weight[48:], up)
    assert not any(p.requires_grad for p in model.parameters())


def test_sharded_checkpoint_same_as_single(model_dir, tmp_path):
    single, cfg = load_model(model_dir)
    sharded = tmp_path / "sharded"
    shutil.copytree(model_dir, sharded)
    tensors = load_file(str(sharded / "model.safetensors"))
    (sharded / "model.safetensors").unlink()
    names = sorted(tensors)
    parts = [names[: len(names) // 2], names[len(names) // 2:]]
    weight_map = {}
    for i, part in enumerate(parts):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(sharded / fname))
        weight_map.update({n: fname for n in part})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    model, _ = load_model(sharded)
    ids = [5, 9, 100, 7, 3, 42]
    assert torch.equal(_last_logits(model, cfg, ids), _last_logits(single, cfg, ids))


def test_dtype_auto_and_bad_dtype(model_dir):
    model, _ = load_model(model_dir, dtype="auto")  # config.json says float32
    assert next(model.parameters()).dtype == torch.float32
    with pytest.raises(ValueError, match="unsupported dtype 'int8'"):
        load_model(model_dir, dtype="int8")


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_missing_config(model_dir):
    (model_dir / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="missing config.json"):
        load_model(model_dir)


def test_missing_weights(model_dir):
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no weights.*model.safetensors"):
        load_model(model_dir)


def test_missing_shard_named_in_index(model_dir):
    (model_dir / "model.safetensors").unlink()
    (model_dir / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="model-00001-of-00002.safetensors"):
        load_model(model_dir)


def test_missing_tokenizer(model_dir):
    (model_dir / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        check_model_dir(model_dir)
    model, _ = load_model(model_dir, require_tokenizer=False)
    assert model is not None


def test_unsupported_architecture(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["architectures"] = ["MistralForCausalLM"]
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as exc:
        load_model(model_dir)
    msg = str(exc.value)
    assert "MistralForCausalLM" in msg
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert arch in msg


def test_shape_mismatch_names_tensor_and_shapes(model_dir):
    def shrink(t):
        t["model.layers.1.mlp.down_proj.weight"] = torch.zeros(32, 40)

    _edit_weights(model_dir, shrink)
    with pytest.raises(ValueError) as exc:
        load_model(model_dir)
    msg = str(exc.value)
    assert "model.layers.1.mlp.down_proj.weight" in msg
    assert "[32, 40]" in msg and "expected [32, 48]" in msg


def test_missing_tensor(model_dir):
    _edit_weights(model_dir, lambda t: t.pop("model.layers.0.self_attn.k_norm.weight"))
    with pytest.raises(ValueError, match=r"missing tensor\(s\).*model\.layers\.0\.self_attn\.k_norm\.weight"):
        load_model(model_dir)


def test_unexpected_tensor(model_dir):
    def add(t):
        t["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(32)

    _edit_weights(model_dir, add)
    with pytest.raises(ValueError, match=r"unexpected tensor\(s\).*model\.layers\.0\.self_attn\.q_proj\.bias"):
        load_model(model_dir)


def test_untied_needs_lm_head(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["tie_word_embeddings"] = False
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"missing tensor\(s\).*lm_head\.weight"):
        load_model(model_dir)
