"""Tokenizer on the ``tokenizers`` library plus the HF chat template (no transformers).

Reads tokenizer.json, tokenizer_config.json (special tokens, chat template,
clean-up flag), chat_template.jinja (newer transformers writes the template there) and
generation_config.json (extra eos ids). The chat template runs in a sandboxed jinja2
environment set up like transformers' (trim_blocks, lstrip_blocks, loopcontrols,
``raise_exception``, ``strftime_now``, a non-escaping ``tojson``).
"""

from __future__ import annotations

import json
import logging
import pathlib
import re
from datetime import datetime
from functools import lru_cache
from typing import Any, Iterable, Sequence

logger = logging.getLogger(__name__)

_SPECIAL_ATTRS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token",
                  "cls_token", "mask_token")
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _token_content(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, dict):
        return value.get("content")
    return str(value)


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of the GPT-2 byte-level alphabet (byte -> printable char)."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _uses_byte_level(node: Any) -> bool:
    if not isinstance(node, dict):
        return False
    if node.get("type") == "ByteLevel":
        return True
    return any(_uses_byte_level(d) for d in node.get("decoders") or [])


@lru_cache(maxsize=32)
def _compile_template(source: str) -> Any:
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _GenerationTag(Extension):
        """``{% generation %}...{% endgeneration %}``: rendered as its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


class Tokenizer:
    """``encode``/``decode``/``apply_chat_template`` with transformers-identical output."""

    def __init__(self, backend: Any, config: dict[str, Any], chat_template: str | None,
                 extra_eos_ids: Sequence[int] = ()) -> None:
        self._tok = backend
        self._config = config
        self.chat_template = chat_template
        # transformers skips the (WordPiece-era) clean-up for BPE models unless forced
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False)) and (
            type(backend.model).__name__ != "BPE" or bool(config.get(
                "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)))
        self.special_tokens: dict[str, str] = {}
        for attr in _SPECIAL_ATTRS:
            content = _token_content(config.get(attr))
            if content is not None:
                self.special_tokens[attr] = content
        self.bos_token_id = self._id_of(self.special_tokens.get("bos_token"))
        self.pad_token_id = self._id_of(self.special_tokens.get("pad_token"))
        eos: list[int] = []
        eos_id = self._id_of(self.special_tokens.get("eos_token"))
        if eos_id is not None:
            eos.append(eos_id)
        eos.extend(int(i) for i in extra_eos_ids)
        self.eos_token_ids: list[int] = list(dict.fromkeys(eos))
        special = {tid for tid, tok in backend.get_added_tokens_decoder().items() if tok.special}
        for content in self.special_tokens.values():
            tid = self._id_of(content)
            if tid is not None:
                special.add(tid)
        self.all_special_ids: list[int] = sorted(special)
        self._byte_level = False
        self._byte_cache: dict[int, bytes] = {}

    @classmethod
    def from_dir(cls, path: str | pathlib.Path) -> "Tokenizer":
        from tokenizers import Tokenizer as _Backend

        path = pathlib.Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"missing tokenizer file tokenizer.json in {str(path)!r}")
        backend = _Backend.from_file(str(tok_file))
        config: dict[str, Any] = {}
        cfg_file = path / "tokenizer_config.json"
        if cfg_file.is_file():
            config = json.loads(cfg_file.read_text(encoding="utf-8"))
        template = config.get("chat_template")
        jinja_file = path / "chat_template.jinja"
        if jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        elif isinstance(template, list):  # named templates: take "default"
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default")
        extra_eos: list[int] = []
        gen_file = path / "generation_config.json"
        if gen_file.is_file():
            gen_eos = json.loads(gen_file.read_text(encoding="utf-8")).get("eos_token_id")
            if isinstance(gen_eos, int):
                extra_eos = [gen_eos]
            elif isinstance(gen_eos, list):
                extra_eos = [int(i) for i in gen_eos]
        tok = cls(backend, config, template, extra_eos)
        tok._byte_level = _uses_byte_level(json.loads(tok_file.read_text(encoding="utf-8")).get("decoder"))
        return tok

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Iterable[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts),
                                                      add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if self.clean_up_tokenization_spaces:
            text = _clean_up_tokenization(text)
        return text

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def token_to_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for (a partial UTF-8 sequence is possible)."""
        cached = self._byte_cache.get(token_id)
        if cached is not None:
            return cached
        token = self._tok.id_to_token(token_id)
        if token is None:
            raise ValueError(f"token id {token_id} is out of range (vocab {self.vocab_size})")
        if token_id in self.all_special_ids:
            out = token.encode("utf-8")
        elif self._byte_level:
            table = _unicode_to_byte()
            out = bytes(table[c] for c in token) if all(c in table for c in token) \
                else token.encode("utf-8")
        else:
            m = _BYTE_TOKEN.match(token)
            out = bytes([int(m.group(1), 16)]) if m else token.replace("▁", " ").encode("utf-8")
        self._byte_cache[token_id] = out
        return out

    def apply_chat_template(self, messages: Sequence[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None,
                            documents: list[dict[str, Any]] | None = None,
                            chat_template: str | None = None, **kwargs: Any) -> str:
        """Render the chat as transformers' ``apply_chat_template(tokenize=False)`` does."""
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError("this tokenizer has no chat template (tokenizer_config.json "
                             "'chat_template' or chat_template.jinja)")
        chat = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                raise ValueError(f"message {i} must be a dict, got {type(message).__name__}")
            message = dict(message)
            for alias in ("thinking", "reasoning"):
                if "reasoning_content" not in message and alias in message:
                    message["reasoning_content"] = message[alias]
            if "reasoning_content" in message and "thinking" not in message:
                message["thinking"] = message["reasoning_content"]
            chat.append(message)
        context = {**self.special_tokens, **kwargs}
        return _compile_template(template).render(
            messages=chat, tools=tools, documents=documents,
            add_generation_prompt=add_generation_prompt, **context)


def _clean_up_tokenization(text: str) -> str:
    return (text.replace(" .", ".").replace(" ?", "?").replace(" !", "!").replace(" ,", ",")
            .replace(" ' ", "'").replace(" n't", "n't").replace(" 'm", "'m")
            .replace(" 's", "'s").replace(" 've", "'ve").replace(" 're", "'re"))
