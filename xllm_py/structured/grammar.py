"""GrammarSpec -> llguidance grammar, and its check (no tokenizer: the HTTP layer and the
master run it; the engine compiles against its own vocabulary in compiler.py).

Library: llguidance (Rust matcher behind a small wheel, no other dependency; JSON schema,
regex and Lark grammars; token masks as bitmasks computed in parallel). xgrammar, the
other maintained choice, pulls triton and torch into every process that validates a
schema, the torch-free master included.

Whitespace in JSON is bounded (DEFAULT_WHITESPACE: one space, or a newline and up to 24
spaces, between two tokens of the JSON text), so a model cannot pad a document without
end: a random-weight model under a schema of enums ends in a few dozen tokens.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict

from xllm_py.structured.spec import GrammarSpec

DEFAULT_WHITESPACE = r"[ ]?|\n[ ]{0,24}"
_CHECK_CACHE_SIZE = 512


class GrammarError(ValueError):
    """The spec is not a grammar llguidance can run; the message names the problem."""


def to_llguidance(spec: GrammarSpec) -> str:
    """The llguidance grammar (its JSON top-level form) of `spec`; GrammarError if the
    spec cannot even be read (JSON that does not parse, choices that are not strings)."""
    import llguidance as llg

    if spec.kind in ("json", "json_object"):
        if spec.kind == "json":
            try:
                schema = json.loads(spec.value)
            except ValueError as e:
                raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise GrammarError("a JSON schema must be an object")
        else:
            schema = {"type": "object"}
        ws = spec.whitespace_pattern
        options = ({"whitespace_flexible": False} if ws == "" else
                   {"whitespace_pattern": DEFAULT_WHITESPACE if ws is None else ws})
        try:
            return llg.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        except ValueError as e:
            raise GrammarError(f"invalid JSON schema: {e}") from None
    if spec.kind == "regex":
        return llg.LLMatcher.grammar_from_regex(spec.value)
    if spec.kind == "choice":
        try:
            options = json.loads(spec.value)
        except ValueError:
            options = None
        if (not isinstance(options, list) or not options
                or not all(isinstance(o, str) and o for o in options)):
            raise GrammarError("choice must be a non-empty list of non-empty strings")
        return llg.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options))
    text = spec.value
    if "::=" in text:  # GBNF (llama.cpp / xgrammar's EBNF): llguidance converts it
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            text = gbnf_to_lark(text)
        except Exception as e:
            raise GrammarError(f"invalid GBNF grammar: {str(e)[:300]}") from None
    return llg.LLMatcher.grammar_from_lark(text)


class _Checked:
    """Results of `check` by spec key (bounded LRU, any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._results: OrderedDict[tuple, str | None] = OrderedDict()

    def get(self, key: tuple) -> tuple[bool, str | None]:
        with self._lock:
            if key in self._results:
                self._results.move_to_end(key)
                return True, self._results[key]
        return False, None

    def put(self, key: tuple, problem: str | None) -> None:
        with self._lock:
            self._results[key] = problem
            while len(self._results) > _CHECK_CACHE_SIZE:
                self._results.popitem(last=False)


_checked = _Checked()


def check(spec: GrammarSpec) -> str | None:
    """Why `spec` cannot be served (a message for the client's 400), or None. Costs up to
    a compile of the grammar without a vocabulary (run it off the event loop: see
    `is_checked`); results are cached by the spec's key."""
    known, problem = _checked.get(spec.key)
    if known:
        return problem
    problem = _check(spec)
    _checked.put(spec.key, problem)
    return problem


def is_checked(spec: GrammarSpec) -> bool:
    """True if `check(spec)` would answer from the cache (no compile)."""
    return _checked.get(spec.key)[0]


def _check(spec: GrammarSpec) -> str | None:
    import llguidance as llg

    try:
        grammar = to_llguidance(spec)
    except GrammarError as e:
        return str(e)
    error = llg.LLMatcher.validate_grammar(grammar)
    if error:
        return f"invalid {_NAMES[spec.kind]}: {_first_lines(error)}"
    return None


_NAMES = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regex",
          "choice": "choice", "grammar": "grammar"}


def _first_lines(text: str, limit: int = 400) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[:limit] + "..."
