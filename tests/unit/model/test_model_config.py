"""ModelConfig parsing: both RoPE spellings, eos ids, head_dim, family flags."""

from __future__ import annotations

import json

import pytest

from xllm_py.model.config import ModelConfig

BASE = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
        "vocab_size": 100}

LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def test_defaults_and_derived_head_dim():
    cfg = ModelConfig.from_dict(dict(BASE))
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2, 4, 2, 16)
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.rms_norm_eps) == (10000.0, None, 1e-6)
    assert (cfg.qkv_bias, cfg.qk_norm, cfg.tie_word_embeddings) == (False, False, False)
    assert cfg.eos_token_ids == [] and cfg.bos_token_id is None


def test_rope_legacy_spelling():
    cfg = ModelConfig.from_dict({**BASE, "rope_theta": 500000.0,
                                 "rope_scaling": {"rope_type": "llama3", **LLAMA3}})
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == {"rope_type": "llama3", **LLAMA3}


def test_rope_parameters_spelling_transformers5():
    cfg = ModelConfig.from_dict({**BASE, "rope_parameters": {"rope_type": "llama3",
                                                             "rope_theta": 500000.0, **LLAMA3}})
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == {"rope_type": "llama3", **LLAMA3}
    plain = ModelConfig.from_dict({**BASE, "rope_parameters": {"rope_type": "default",
                                                               "rope_theta": 1e6}})
    assert (plain.rope_theta, plain.rope_scaling) == (1e6, None)


def test_unsupported_rope_type():
    with pytest.raises(ValueError, match="unsupported rope type 'yarn'"):
        ModelConfig.from_dict({**BASE, "rope_scaling": {"type": "yarn", "factor": 4.0}})


def test_family_flags_and_head_dim_from_config():
    q2 = ModelConfig.from_dict({**BASE, "architectures": ["Qwen2ForCausalLM"]})
    assert (q2.qkv_bias, q2.attention_bias, q2.qk_norm) == (True, False, False)
    q3 = ModelConfig.from_dict({**BASE, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32})
    assert (q3.qkv_bias, q3.qk_norm, q3.head_dim, q3.q_size, q3.kv_size) == (False, True, 32, 128, 64)


def test_eos_from_config_and_generation_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "eos_token_id": 7,
                                                      "bos_token_id": 1, "dtype": "bfloat16"}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, 7, 8]}))
    cfg = ModelConfig.from_dir(tmp_path)
    assert cfg.eos_token_ids == [9, 7, 8]
    assert cfg.bos_token_id == 1
    assert cfg.torch_dtype == "bfloat16"


def test_bad_configs():
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'.*LlamaForCausalLM"):
        ModelConfig.from_dict({**BASE, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="missing 'vocab_size'"):
        ModelConfig.from_dict({k: v for k, v in BASE.items() if k != "vocab_size"})
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ModelConfig.from_dict({**BASE, "num_key_value_heads": 3})
    cfg = ModelConfig.from_dict({k: v for k, v in BASE.items() if k != "architectures"}
                                | {"model_type": "qwen3"})
    assert cfg.architecture == "Qwen3ForCausalLM"
