"""Deterministic tiny HF-format models for tests and benchmarks (no downloads).

``ensure_tiny_model(name)`` builds, once per cache folder, a real model directory:
config.json, generation_config.json, model.safetensors (random normal(0, 0.05) weights
from a fixed seed), and a byte-level BPE tokenizer (tokenizer.json, tokenizer_config.json
with a ChatML chat template) trained on a built-in English corpus. It is written to a temp
folder and renamed into place, so concurrent processes are safe. Load it with
``load_model`` / ``Tokenizer.from_dir`` like any other model.

This module imports no torch: the weights are written by ``tiny_weights.py``, imported
only when they are built. ``model_files_dir`` gives the master the tokenizer and config
of a tiny model without building (or importing) anything heavier.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import random
import shutil
import tempfile
from typing import Any

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_VOCAB_SIZE = 1024
_FORMAT_VERSION = 2  # bump when the files written here change

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Presets: family and shape. "tiny" is ~3M parameters, "tiny-25m" ~25M.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(family="qwen3", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                 intermediate_size=704, seed=0),
    "tiny-25m": dict(family="qwen3", hidden_size=512, num_layers=8, num_heads=8,
                     num_kv_heads=4, intermediate_size=1536, seed=0),
    "tiny-llama": dict(family="llama", hidden_size=256, num_layers=4, num_heads=4,
                       num_kv_heads=2, intermediate_size=704, seed=0),
    # tiny-25m's weights rounded to bfloat16 and stored so, as real checkpoints are
    "tiny-25m-bf16": dict(family="qwen3", hidden_size=512, num_layers=8, num_heads=8,
                          num_kv_heads=4, intermediate_size=1536, seed=0, dtype="bfloat16"),
}

_ARCH = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
         "qwen3": ("Qwen3ForCausalLM", "qwen3")}

_SENTENCES = """\
The quick brown fox jumps over the lazy dog near the river bank.
A small model can still learn the shape of language from a little text.
Every morning the baker opens the shop and sells fresh bread to the town.
The train left the station at seven and arrived in the city before noon.
She wrote a letter to her friend and posted it on the way to work.
Computers follow instructions step by step, one simple operation at a time.
The weather today is cold and windy, with rain expected in the evening.
He planted tomatoes, beans and carrots in the garden behind the house.
Children played in the park while their parents talked on the benches.
The library has thousands of books about history, science and art.
Water boils at one hundred degrees and freezes at zero degrees Celsius.
The engineer checked the bridge carefully before the new road was opened.
Music filled the hall as the orchestra began the first movement.
A good question is often more useful than a quick answer.
The cat slept on the warm window sill for most of the afternoon.
Please send the report by Friday so that the team can review it.
The mountain path was steep, narrow and covered with loose stones.
They counted the stars and tried to name the brightest ones.
Reading every day helps you learn new words and new ideas.
The server answered the request and returned the result to the client.
"""

_WORDS = """
about above across action active actual address advance advice afraid agency agree alive
allow almost alone along already always amount animal annual another answer anyone appear
apple approach area argue around arrive article artist attack attempt attention autumn
average avoid balance banana basket battle beach beautiful become before begin behavior
believe benefit better between beyond birthday blanket border bottom branch breakfast
breath bright bring brother budget building butter button camera campaign candle capital
captain career careful carpet castle center century chance change chapter character cheese
chicken choice circle citizen climate clock closet cloud coffee collect college color
comfort common company compare complete computer concert control corner cotton country
courage cousin create culture current danger daughter decade decide defense degree
deliver design detail develop diamond dinner direct distance doctor dollar double dragon
dream driver during early earth easily economy edition effort eight either electric
element eleven energy engine enough entire escape evening event example exchange exercise
expect expert explain factory family famous farmer father feather feeling figure finger
finish flower follow forest forget format fortune forward freedom friend frozen future
garden gather gentle giant global golden govern grammar grandma grass great ground growth
guitar habit hammer handle happen harbor health heart heavy height helpful history holiday
honest horse hospital hotel hundred hunger husband idea imagine improve include increase
indeed island jacket journey judge jungle kettle kitchen knife ladder language laptop
laughter layer leader leather lemon lesson letter level library light listen little
machine magnet market master matter meadow measure memory message method middle minute
mirror modern moment monkey morning mother motion mountain museum napkin nation nature
needle network never night noise normal notice number object ocean office orange order
origin oxygen packet palace parent partner pencil people pepper period person picture
planet plastic pocket poetry police potato powder practice present problem process
produce program project promise public purple puzzle quarter rabbit radio reason record
region remember repeat report result return rhythm ribbon rocket salad sample science
season second secret section silver simple sister smooth soldier spirit spring square
summer sunset supply surface system talent teacher temple thirty thousand thunder ticket
tomorrow travel triangle trouble tunnel twelve uncle under unique valley velvet victory
village violin visitor volume wagon wallet weather window winter wisdom wonder yellow
yesterday zebra
""".split()

_SUBJECTS = ["the teacher", "a student", "my brother", "the old man", "our neighbor",
             "the scientist", "a young girl", "the farmer", "the pilot", "the writer",
             "the doctor", "a traveler", "the manager", "the child", "the musician"]
_VERBS = ["reads", "finds", "builds", "paints", "carries", "opens", "watches", "cleans",
          "describes", "explains", "remembers", "discovers", "answers", "measures", "writes"]
_OBJECTS = ["a red box", "the long story", "an open window", "the heavy door", "a new song",
            "the blue river", "a quiet room", "the simple problem", "a bright lamp",
            "the second chapter", "an empty bottle", "the wooden table", "a paper map",
            "the first question", "a green field"]
_PLACES = ["in the morning", "at night", "near the station", "after lunch", "before dinner",
           "in the garden", "on the hill", "by the sea", "during the storm", "at school",
           "in the kitchen", "under the bridge", "at the market", "in the city", "at home"]


def training_corpus() -> list[str]:
    """The fixed English corpus the tiny tokenizer is trained on."""
    rng = random.Random(1234)
    lines = _SENTENCES.splitlines()
    for _ in range(3000):
        s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_PLACES)}."
        lines.append(s[0].upper() + s[1:])
    for _ in range(1500):
        lines.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 12))).capitalize() + ".")
    for i in range(200):
        lines.append(f"Item {i} costs {rng.randint(1, 999)} dollars and {rng.randint(0, 99)} cents.")
    lines.append("Hello, world! How are you? I am fine: thanks (really) - 100% sure; ok?")
    return lines


def build_tokenizer_files(path: pathlib.Path, vocab_size: int = TINY_VOCAB_SIZE) -> int:
    """Train the byte-level BPE and write tokenizer.json + tokenizer_config.json.

    Returns the tokenizer's vocabulary size (special tokens included).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(training_corpus(), trainer=trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False,
                                  "rstrip": False, "single_word": False, "special": True}
        for t in SPECIAL_TOKENS
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "chat_template": CHATML_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return tok.get_vocab_size()


def build_model_dir(path: str | pathlib.Path, *, family: str = "qwen3", hidden_size: int = 256,
                    num_layers: int = 4, num_heads: int = 4, num_kv_heads: int = 2,
                    intermediate_size: int = 704, head_dim: int | None = None,
                    max_position_embeddings: int = 2048, tie_word_embeddings: bool = True,
                    rope_theta: float = 10000.0, seed: int = 0,
                    init_std: float = 0.05, with_weights: bool = True,
                    dtype: str = "float32") -> pathlib.Path:
    """Write a complete HF-format model directory with random weights; returns the path.

    The vocabulary comes from the tiny tokenizer (written alongside). Only torch,
    safetensors and tokenizers are needed. ``init_std`` 0.05: at 0.02 greedy decoding
    of these random models repeats a single token. ``with_weights=False`` writes every
    file but model.safetensors, without importing torch (what the master needs).
    ``dtype``: the stored weights' dtype, ``float32`` or ``bfloat16`` (the float32 draws
    rounded).
    """
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    if family not in _ARCH:
        raise ValueError(f"unknown family {family!r}; choose from {', '.join(_ARCH)}")
    if hidden_size % num_heads and head_dim is None:
        raise ValueError("hidden_size must be divisible by num_heads when head_dim is not given")
    path = pathlib.Path(path)
    vocab = build_tokenizer_files(path)
    hd = head_dim or hidden_size // num_heads
    arch, model_type = _ARCH[family]
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    eos = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    config: dict[str, Any] = {
        "architectures": [arch],
        "model_type": model_type,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": hd,
        "intermediate_size": intermediate_size,
        "vocab_size": vocab,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "tie_word_embeddings": tie_word_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "bos_token_id": None,
        "eos_token_id": eos[0],
        "pad_token_id": eos[1],
        "dtype": dtype,
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": eos, "pad_token_id": eos[1]}, indent=2))

    if with_weights:
        from xllm_py.model.tiny_weights import write_random_weights

        write_random_weights(path, family=family, vocab=vocab, hidden_size=hidden_size,
                             num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=hd,
                             num_heads=num_heads, intermediate_size=intermediate_size,
                             tie_word_embeddings=tie_word_embeddings, seed=seed,
                             init_std=init_std, dtype=dtype)
    return path


def default_cache_dir() -> pathlib.Path:
    from xllm_py.config import model_cache_dir_from_env

    env = model_cache_dir_from_env()
    if env:
        return pathlib.Path(env)
    return pathlib.Path.home() / ".cache" / "xllm_py" / "models"


def ensure_tiny_model(name: str = "tiny", cache_dir: str | pathlib.Path | None = None,
                      *, with_weights: bool = True) -> pathlib.Path:
    """Return the directory of the named tiny model, building it on first use.

    ``with_weights=False`` (the master: tokenizer, chat template and config only, no
    torch): the full model's directory when it is built, else ``<name>.noweights``, the
    same files but model.safetensors (the tokenizer training is deterministic, so both
    hold the same tokenizer).
    """
    if name not in PRESETS:
        raise ValueError(f"unknown tiny model {name!r}; choose from {', '.join(PRESETS)}")
    root = pathlib.Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / name
    if _is_current(target):
        return target
    if not with_weights:
        target = root / f"{name}.noweights"
        if _is_current(target):
            return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
    try:
        build_model_dir(tmp, **PRESETS[name], with_weights=with_weights)
        (tmp / ".complete").write_text(str(_FORMAT_VERSION))
        if target.exists() and not _is_current(target):
            # interrupted build or older format: move it aside, then replace it
            stale = pathlib.Path(tempfile.mkdtemp(prefix=f".{name}.stale.", dir=root))
            try:
                os.replace(target, stale / "old")
            except OSError:
                pass  # another process moved it first
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(tmp, target)
            logger.info("built tiny model %r in %s", name, target)
        except OSError:
            if not _is_current(target):
                raise
            # another process finished first; its files are identical
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def model_files_dir(model: str) -> str:
    """Where `model`'s tokenizer and config are, without importing torch: the directory
    as given, for a tiny preset ("tiny...") its files (see `ensure_tiny_model`), for a
    packaged model or a .gguf file its converted files (catalog.py)."""
    from xllm_py.model.catalog import resolve_model

    return resolve_model(model, with_weights=False)


def _is_current(target: pathlib.Path) -> bool:
    marker = target / ".complete"
    try:
        return marker.read_text().strip() == str(_FORMAT_VERSION)
    except OSError:
        return False
