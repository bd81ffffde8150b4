"""GrammarSpec: what a request constrains its output to (pure Python, no llguidance).

One spec per request, carried as it is from the HTTP layer through SamplingParams and the
wire (DisaggRequest.structured_output) to every engine that samples for it, so a PD
decode or a migration target rebuilds the same matcher. `key` is the cache key of its
compiled grammar.

kinds:
  json         value: a JSON schema (JSON text without spaces; key order kept: properties
               are generated in the order they are declared)
  json_object  value: "" (any JSON object: OpenAI's JSON mode)
  regex        value: a regular expression (Rust regex syntax, whole output)
  choice       value: a JSON list of strings (the output is exactly one of them)
  grammar      value: a Lark grammar (llguidance's dialect; GBNF is converted)
whitespace_pattern (json kinds): None, the bounded default (grammar.DEFAULT_WHITESPACE);
"" none at all (vLLM's disable_any_whitespace); else a regex for whitespace between tokens.
"""
from __future__ import annotations

import dataclasses
import json

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 1 << 20  # a schema / grammar text; bodies are capped before this anyway


@dataclasses.dataclass(frozen=True)
class GrammarSpec:
    kind: str
    value: str = ""
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(KINDS)}, "
                             f"got {self.kind!r}")
        if not isinstance(self.value, str) or len(self.value) > MAX_SPEC_CHARS:
            raise ValueError(f"structured output {self.kind} must be a string of at most "
                             f"{MAX_SPEC_CHARS} characters")
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            raise ValueError("whitespace_pattern must be a string or null")

    @property
    def key(self) -> tuple[str, str, str | None]:
        return (self.kind, self.value, self.whitespace_pattern)

    @classmethod
    def json_schema(cls, schema: object, whitespace_pattern: str | None = None) -> "GrammarSpec":
        return cls("json", canonical_json(schema), whitespace_pattern)

    @classmethod
    def choices(cls, options: list[str]) -> "GrammarSpec":
        return cls("choice", json.dumps(list(options), ensure_ascii=False))

    def anon_repr(self) -> str:
        return f"GrammarSpec(kind={self.kind}, {len(self.value)} chars)"

    __repr__ = anon_repr


def canonical_json(value: object) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
