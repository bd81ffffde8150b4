"""Tokenizer: same ids, text and chat-template strings as transformers' AutoTokenizer."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import processors

from xllm_py.model.tiny import build_tokenizer_files
from xllm_py.model.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello, world!",
    "The engineer checked the bridge carefully before the new road was opened.",
    "  leading spaces and\ttabs\nnew lines\n\n",
    "Unicode: naïve café, 日本語, emoji 🙂 and ünïcödé.",
    "special tokens inline <|im_start|>user\nhi<|im_end|> done",
    "spaces before . and , and ? do n't they 're",
    "numbers 3.14159 and 1,000,000 and -42",
    "",
]

LLAMA_STYLE_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['user', 'assistant', 'system'] %}"
    "{{ raise_exception('bad role ' + m['role']) }}{% endif %}"
    "[{{ m['role'] | upper }}] {{ m['content'] | trim }}\n"
    "{% endfor %}{% if add_generation_prompt %}[ASSISTANT] {% endif %}"
)

MESSAGES = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?  "},
]


@pytest.fixture(scope="module")
def chatml_dir(tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("chatml")
    build_tokenizer_files(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return path


@pytest.fixture(scope="module")
def bos_dir(chatml_dir, tmp_path_factory) -> pathlib.Path:
    """Adds a BOS through the post-processor, template in chat_template.jinja, clean-up on."""
    path = tmp_path_factory.mktemp("bos")
    backend = Backend.from_file(str(chatml_dir / "tokenizer.json"))
    backend.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|endoftext|> $A", pair="<|endoftext|> $A $B",
                                      special_tokens=[("<|endoftext|>", 0)]),
    ])
    backend.save(str(path / "tokenizer.json"))
    cfg = json.loads((chatml_dir / "tokenizer_config.json").read_text())
    cfg.update(bos_token="<|endoftext|>", eos_token="<|im_end|>", add_bos_token=True,
               clean_up_tokenization_spaces=True)
    cfg.pop("chat_template")
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (path / "chat_template.jinja").write_text(LLAMA_STYLE_TEMPLATE)
    return path


@pytest.mark.parametrize("which", ["chatml_dir", "bos_dir"])
def test_encode_decode_match_transformers(which, request):
    path = request.getfixturevalue(which)
    ours = Tokenizer.from_dir(path)
    ref = transformers.AutoTokenizer.from_pretrained(str(path))
    for text in TEXTS:
        for add in (True, False):
            ids = ours.encode(text, add_special_tokens=add)
            assert ids == ref.encode(text, add_special_tokens=add), text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(
                ids, skip_special_tokens=skip), text
    assert ours.vocab_size == len(ref) == 1024


def test_bos_is_added(bos_dir):
    tok = Tokenizer.from_dir(bos_dir)
    assert tok.bos_token_id == 0
    assert tok.encode("hi")[0] == 0
    assert tok.encode("hi", add_special_tokens=False)[0] != 0
    # clean_up_tokenization_spaces=True is ignored for BPE models, as transformers does
    ids = tok.encode("Yes . No ? I do n't", add_special_tokens=False)
    assert tok.decode(ids) == "Yes . No ? I do n't"


def test_clean_up_forced_for_bpe(bos_dir, tmp_path):
    for name in ("tokenizer.json", "chat_template.jinja"):
        shutil.copy(bos_dir / name, tmp_path / name)
    cfg = json.loads((bos_dir / "tokenizer_config.json").read_text())
    cfg["clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"] = True
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    ours = Tokenizer.from_dir(tmp_path)
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ids = ours.encode("Yes . No ? I do n't", add_special_tokens=False)
    assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True) == "Yes. No? I don't"


@pytest.mark.parametrize("which", ["chatml_dir", "bos_dir"])
@pytest.mark.parametrize("gen_prompt", [True, False])
def test_chat_template_matches_transformers(which, gen_prompt, request):
    path = request.getfixturevalue(which)
    ours = Tokenizer.from_dir(path)
    ref = transformers.AutoTokenizer.from_pretrained(str(path))
    got = ours.apply_chat_template(MESSAGES, add_generation_prompt=gen_prompt)
    want = ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen_prompt)
    assert got == want


def test_chatml_exact_string(chatml_dir):
    tok = Tokenizer.from_dir(chatml_dir)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_template_helpers(bos_dir):
    tok = Tokenizer.from_dir(bos_dir)
    import jinja2

    with pytest.raises(jinja2.TemplateError, match="bad role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    out = tok.apply_chat_template([], chat_template="{{ strftime_now('%Y') | length }}"
                                  "{{ {'a': 'é'} | tojson }}{{ custom }}", custom="!")
    assert out == '4{"a": "é"}!'


def test_special_ids_and_eos(chatml_dir):
    tok = Tokenizer.from_dir(chatml_dir)
    assert tok.eos_token_ids == [2, 0]  # tokenizer_config eos first, then generation_config
    assert tok.pad_token_id == 0
    assert tok.bos_token_id is None
    assert tok.all_special_ids == [0, 1, 2]
    assert [tok.id_to_token(i) for i in range(3)] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def test_token_to_bytes_rebuilds_text(chatml_dir):
    tok = Tokenizer.from_dir(chatml_dir)
    text = "Unicode: naïve café, 日本語 🙂"
    ids = tok.encode(text)
    assert b"".join(tok.token_to_bytes(i) for i in ids).decode("utf-8") == text
    assert tok.token_to_bytes(tok.token_to_id("Ġthe")) == b" the"


def test_missing_tokenizer_json(tmp_path, chatml_dir):
    shutil.copy(chatml_dir / "tokenizer_config.json", tmp_path / "tokenizer_config.json")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
