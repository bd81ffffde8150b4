"""A GGUF file as a Hugging Face model directory (torch-free: gguf, numpy, tokenizers).

``ensure_gguf_model_dir(path)`` converts once per cache folder and returns a directory the
rest of the project loads like any other: config.json (the HF config the GGUF metadata
stands for), generation_config.json, tokenizer.json + tokenizer_config.json (built from
the GGUF's vocabulary, with the chat template the family uses when the file has none) and
model.safetensors (every tensor dequantized to float32 by the ``gguf`` package's own
readers, named as the HF checkpoint names it), and beside it gguf/blocks.safetensors: the
file's own blocks (uint8 rows, as ``GGUFReader`` gives them) of every weight in a type the
native kernels keep quantized (Q4_K, Q6_K: kquant_panels.py), under the same HF names, in
a folder of its own so that tools globbing ``*.safetensors`` never take them for weights.
``with_weights=False`` (the master) writes all but the weights. A directory written
without the blocks (before they were kept) gets them added in place, under the lock. Concurrent processes wait on one lock; the files are written to a
temporary folder and renamed into place.

Supported: architecture ``gemma3`` (Gemma 3 text). Facts about what the converter that
wrote the file changed: llama.cpp stores Gemma's norm weights with the 1 of ``(1 + w)``
added; the HF checkpoint (and transformers loading the GGUF) has ``w``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import pathlib
import re
import shutil
import tempfile
from typing import Any, Iterator

logger = logging.getLogger(__name__)

_FORMAT_VERSION = 1  # bump when the files written here change (not for the blocks: added)
_BLOCK_TYPES = ("Q4_K", "Q6_K")  # kept as raw blocks too (kquant_panels.TYPES)
BLOCKS_FILE = pathlib.Path("gguf") / "blocks.safetensors"

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.")
_GEMMA3_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GEMMA3_TOP_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)\.(weight|bias)$")
_TOP = re.compile(r"^([a-z_]+)\.(weight|bias)$")

# Google's Gemma chat format: turns of <start_of_turn>{role}\n...<end_of_turn>\n, the
# assistant's role named "model", a system message folded into the first user turn.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '')"
    " + (message['content'] | trim) + '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)
_END_OF_TURN = "<end_of_turn>"

# llama.cpp token types (tokenizer.ggml.token_type)
_CONTROL, _USER_DEFINED = 3, 4


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def hf_tensor_name(gguf_name: str) -> str:
    """The HF checkpoint name of a Gemma 3 GGUF tensor; ValueError for an unknown one."""
    m = _BLOCK.match(gguf_name)
    if m and m.group(2) in _GEMMA3_LAYER_TENSORS:
        return f"model.layers.{m.group(1)}.{_GEMMA3_LAYER_TENSORS[m.group(2)]}.{m.group(3)}"
    m = _TOP.match(gguf_name)
    if m and m.group(1) in _GEMMA3_TOP_TENSORS:
        return f"{_GEMMA3_TOP_TENSORS[m.group(1)]}.{m.group(2)}"
    raise ValueError(f"unexpected tensor {gguf_name!r} in a gemma3 GGUF")


def hf_config(reader: Any) -> dict[str, Any]:
    """config.json of the GGUF's model (Gemma 3 text), as transformers reads the file."""
    arch = _field(reader, "general.architecture")
    if arch != "gemma3":
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: gemma3)")

    def meta(key: str, default: Any = None) -> Any:
        return _field(reader, f"gemma3.{key}", default)

    num_layers = int(meta("block_count"))
    heads = int(meta("attention.head_count"))
    hidden = int(meta("embedding_length"))
    names = {t.name for t in reader.tensors}
    vocab = len(_field(reader, "tokenizer.ggml.tokens"))
    # Gemma 3: five sliding-window layers, then one global (the architecture, not the file)
    types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
             for i in range(num_layers)]
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", heads)),
        "head_dim": int(meta("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(meta("context_length", 32768)),
        "sliding_window": int(meta("attention.sliding_window", 4096)),
        "layer_types": types,
        "rope_parameters": {
            "full_attention": {"rope_type": "default",
                               "rope_theta": float(meta("rope.freq_base", 1e6))},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "query_pre_attn_scalar": int(meta("attention.key_length", hidden // heads)),
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "tie_word_embeddings": "output.weight" not in names,
        "vocab_size": vocab,
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id", 2)),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id", 1)),
        "pad_token_id": int(_field(reader, "tokenizer.ggml.padding_token_id", 0)),
        "torch_dtype": "float32",
    }


def bpe_merges(tokens: list[str]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary without a merge list implies: every split
    of a token into two tokens of the vocabulary, best first by the token's place in the
    file (Gemma's scores do not follow its merge order; the file order does), then the
    longer left piece, then the longer right piece."""
    index = {tok: i for i, tok in enumerate(tokens)}  # a repeated spelling: the last one
    found: list[tuple[int, int, int, str, str]] = []
    for merged, rank in index.items():
        local = []
        for cut in range(1, len(merged)):
            left, right = merged[:cut], merged[cut:]
            li, ri = index.get(left), index.get(right)
            if li is not None and ri is not None:
                local.append((li, ri, left, right))
        local.sort()
        found.extend((rank, -len(left), -len(right), left, right) for _, _, left, right in local)
    found.sort(key=lambda m: m[:3])  # stable: ties keep the order they were found in
    return [(left, right) for _, _, _, left, right in found]


def build_tokenizer(reader: Any) -> tuple[Any, dict[str, Any]]:
    """(tokenizers.Tokenizer, tokenizer_config) of a GGUF with a SentencePiece ('llama')
    vocabulary: byte-fallback BPE, spaces as U+2581, BOS added when the file says so,
    control tokens special, user-defined tokens matched whole."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers, processors

    model = _field(reader, "tokenizer.ggml.model")
    if model != "llama":
        raise ValueError(f"GGUF tokenizer model {model!r} is not supported (supported: llama)")
    raw = [str(t) for t in _field(reader, "tokenizer.ggml.tokens")]
    types = list(_field(reader, "tokenizer.ggml.token_type") or [1] * len(raw))
    # a token of only spaces is stored with real spaces; the text has U+2581 there
    tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in raw]
    vocab = {tok: i for i, tok in enumerate(tokens)}

    def name(key: str, fallback: str) -> str:
        tid = _field(reader, f"tokenizer.ggml.{key}_token_id")
        return raw[int(tid)] if tid is not None and 0 <= int(tid) < len(raw) else fallback

    bos, eos, unk, pad = (name("bos", "<bos>"), name("eos", "<eos>"), name("unknown", "<unk>"),
                          name("padding", "<pad>"))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=bpe_merges(tokens), unk_token=unk,
                               fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse()])
    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", True))
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1",
            special_tokens=[(bos, vocab[bos])])
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, ty in zip(raw, types) if ty == _CONTROL])
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, ty in zip(raw, types) if ty == _USER_DEFINED and t in vocab])
    config: dict[str, Any] = {
        "bos_token": bos, "eos_token": eos, "unk_token": unk, "pad_token": pad,
        "add_bos_token": add_bos, "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    template = _field(reader, "tokenizer.chat_template")
    if template is None and _field(reader, "general.architecture") == "gemma3":
        template = GEMMA_CHAT_TEMPLATE
    if template is not None:
        config["chat_template"] = str(template)
    return tok, config


def dequantized_tensors(reader: Any) -> Iterator[tuple[str, Any]]:
    """(HF name, float32 numpy array in the HF layout) for every tensor of the file."""
    import numpy as np
    from gguf.quants import dequantize

    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        arr = np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if name.endswith("norm.weight"):
            arr = arr - np.float32(1.0)  # llama.cpp stored 1 + w
        yield name, arr


def write_blocks(reader: Any, out: pathlib.Path, source: str) -> int:
    """out/gguf/blocks.safetensors: the raw blocks of the file's 2-D weights in
    ``_BLOCK_TYPES`` (HF names; their types in the metadata, JSON under "types"), written to
    a temporary name and renamed. Returns how many."""
    import numpy as np
    from safetensors.numpy import save_file

    blocks: dict[str, Any] = {}
    types: dict[str, str] = {}
    for t in reader.tensors:
        if t.tensor_type.name in _BLOCK_TYPES and len(t.shape) == 2 and t.name != "token_embd.weight":
            name = hf_tensor_name(t.name)
            blocks[name] = np.ascontiguousarray(t.data, dtype=np.uint8)
            types[name] = t.tensor_type.name
    path = out / BLOCKS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file(blocks, str(tmp), metadata={"types": json.dumps(types), "source": source})
    os.replace(tmp, path)
    return len(blocks)


def _write_dir(gguf_path: pathlib.Path, out: pathlib.Path, with_weights: bool) -> None:
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    config = hf_config(reader)
    tok, tok_config = build_tokenizer(reader)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    eos = [config["eos_token_id"]]
    end_of_turn = tok.token_to_id(_END_OF_TURN)
    if end_of_turn is not None:
        eos.append(end_of_turn)  # a chat turn ends the reply
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config["bos_token_id"], "eos_token_id": eos,
         "pad_token_id": config["pad_token_id"]}, indent=2))
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    if with_weights:
        from safetensors.numpy import save_file

        save_file(dict(dequantized_tensors(reader)), str(out / "model.safetensors"),
                  metadata={"format": "pt", "source": gguf_path.name})
        write_blocks(reader, out, gguf_path.name)
    (out / ".complete").write_text(str(_FORMAT_VERSION))


def _is_current(path: pathlib.Path) -> bool:
    try:
        return (path / ".complete").read_text().strip() == str(_FORMAT_VERSION)
    except OSError:
        return False


def _has_blocks(path: pathlib.Path) -> bool:
    return (path / BLOCKS_FILE).is_file()


@contextlib.contextmanager
def _locked(lock_path: pathlib.Path) -> Iterator[None]:
    with open(lock_path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def cache_root() -> pathlib.Path:
    from xllm_py.config import model_cache_dir_from_env

    env = model_cache_dir_from_env()
    return (pathlib.Path(env) if env else pathlib.Path.home() / ".cache" / "xllm_py" / "models")


def ensure_gguf_model_dir(gguf_path: str | pathlib.Path, *, with_weights: bool = True,
                          cache_dir: str | pathlib.Path | None = None) -> pathlib.Path:
    """The HF directory of a GGUF file, converted on first use (see the module doc)."""
    src = pathlib.Path(gguf_path).resolve()
    if not src.is_file():
        raise FileNotFoundError(f"GGUF file {str(gguf_path)!r} does not exist")
    st = src.stat()
    key = hashlib.sha256(f"{src}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    root = pathlib.Path(cache_dir) if cache_dir is not None else cache_root()
    target = root / f"{src.stem}-{key}"
    files_only = root / f"{src.stem}-{key}.noweights"
    if _is_current(target) and (_has_blocks(target) or not with_weights):
        return target
    if not with_weights and _is_current(files_only):
        return files_only
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f".{src.stem}-{key}.lock"):
        dest = target if with_weights else files_only
        if _is_current(target) and not _has_blocks(target):  # written before the blocks
            from gguf import GGUFReader

            logger.info("adding the GGUF blocks of %s to its model directory", src.name)
            write_blocks(GGUFReader(str(src)), target, src.name)
        if _is_current(target) or _is_current(dest):
            return target if _is_current(target) else dest
        logger.info("converting %s to a model directory (once: it is cached in %s)",
                    src.name, root)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{src.stem}.", dir=root))
        try:
            _write_dir(src, tmp, with_weights)
            if dest.exists():
                shutil.rmtree(dest, ignore_errors=True)
            os.rename(tmp, dest)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return dest
