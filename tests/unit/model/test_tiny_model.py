"""ensure_tiny_model: deterministic, atomic, loadable, sized as documented."""

from __future__ import annotations

import hashlib
import pathlib
import threading

import pytest
import torch

from xllm_py.model.attention import AttentionMetadata, allocate_kv_caches, build_positions
from xllm_py.model.loader import load_model
from xllm_py.model.tiny import build_model_dir, ensure_tiny_model
from xllm_py.model.tokenizer import Tokenizer

pytestmark = pytest.mark.integration  # builds and loads the tiny models

FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
         "tokenizer_config.json"]


def _digest(path: pathlib.Path) -> dict[str, str]:
    return {f: hashlib.sha256((path / f).read_bytes()).hexdigest() for f in FILES}


def _greedy(model, cfg, ids: list[int], n: int) -> list[int]:
    bs = 8
    caches = allocate_kv_caches(cfg.num_layers, 32, bs, cfg.num_kv_heads, cfg.head_dim)
    table = list(range(1, 32))
    out: list[int] = []
    step_ids, start = list(ids), 0
    with torch.inference_mode():
        for _ in range(n):
            seqs = [(start, len(step_ids), table)]
            h = model(torch.tensor(step_ids), build_positions(seqs),
                      AttentionMetadata.build(seqs, bs), caches)
            tok = int(model.compute_logits(h[-1:]).argmax(-1))
            out.append(tok)
            start += len(step_ids)
            step_ids = [tok]
    return out


def test_tiny_model_is_deterministic_and_loads(tmp_path):
    a = ensure_tiny_model("tiny", cache_dir=tmp_path / "a")
    b = ensure_tiny_model("tiny", cache_dir=tmp_path / "b")
    assert a == tmp_path / "a" / "tiny"
    assert _digest(a) == _digest(b)
    assert ensure_tiny_model("tiny", cache_dir=tmp_path / "a") == a  # cached: no rebuild
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["tiny"]  # no temp leftovers

    model, cfg = load_model(a)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"\ntiny: {num_params / 1e6:.2f}M params, vocab {cfg.vocab_size}")
    assert 2e6 <= num_params <= 5e6
    assert cfg.architecture == "Qwen3ForCausalLM"
    assert cfg.vocab_size == 1024
    tok = Tokenizer.from_dir(a)
    assert cfg.eos_token_ids == [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hello there"}]))
    first = _greedy(model, cfg, prompt, 12)
    assert first == _greedy(model, cfg, prompt, 12)
    assert len(set(first)) > 1
    assert isinstance(tok.decode(first), str)


def test_concurrent_builders_agree(tmp_path):
    results: list[pathlib.Path] = []
    errors: list[BaseException] = []

    def build() -> None:
        try:
            results.append(ensure_tiny_model("tiny", cache_dir=tmp_path))
        except BaseException as exc:  # noqa: BLE001 - surfaced by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert results == [tmp_path / "tiny"] * 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]
    load_model(tmp_path / "tiny")


def test_stale_or_old_format_is_rebuilt(tmp_path):
    target = tmp_path / "tiny"
    target.mkdir()
    (target / "config.json").write_text("{}")  # interrupted build: no marker
    assert ensure_tiny_model("tiny", cache_dir=tmp_path) == target
    assert (target / ".complete").read_text() != "0"
    load_model(target)
    (target / ".complete").write_text("0")  # an older format version
    (target / "model.safetensors").unlink()
    assert ensure_tiny_model("tiny", cache_dir=tmp_path) == target
    load_model(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]


def test_cache_dir_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("XLLM_CACHE_DIR", str(tmp_path))
    assert ensure_tiny_model() == tmp_path / "tiny"


def test_unknown_name_and_family(tmp_path):
    with pytest.raises(ValueError, match="unknown tiny model 'huge'.*tiny-25m"):
        ensure_tiny_model("huge", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="unknown family 'gpt2'"):
        build_model_dir(tmp_path / "x", family="gpt2")


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_build_model_dir_other_families(tmp_path, family):
    path = build_model_dir(tmp_path / family, family=family, hidden_size=32, num_layers=1,
                           num_heads=2, num_kv_heads=1, intermediate_size=64,
                           tie_word_embeddings=False, seed=1)
    model, cfg = load_model(path)
    assert cfg.architecture == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[family]
    assert cfg.tie_word_embeddings is False
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert len(_greedy(model, cfg, [5, 6, 7], 3)) == 3


def test_tiny_25m_preset_size(tmp_path):
    from xllm_py.model.tiny import PRESETS

    p = PRESETS["tiny-25m"]
    h, n, hd = p["hidden_size"], p["num_layers"], p["hidden_size"] // p["num_heads"]
    q, kv, inter = p["num_heads"] * hd, p["num_kv_heads"] * hd, p["intermediate_size"]
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * inter + 2 * h + 2 * hd
    total = 1024 * h + n * per_layer + h
    assert 22e6 <= total <= 28e6
