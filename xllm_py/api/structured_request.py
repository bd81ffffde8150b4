"""A request's structured output: OpenAI's response_format, vLLM's structured_outputs
and the older guided_* fields -> one GrammarSpec (or None), checked.

  response_format  {"type": "text"} | {"type": "json_object"}
                   | {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
  structured_outputs {json | regex | choice | grammar | json_object: true,
                      disable_any_whitespace, whitespace_pattern}
  guided_json | guided_regex | guided_choice | guided_grammar, guided_whitespace_pattern,
  guided_decoding_backend (auto / guidance / llguidance: this server has only llguidance)

At most one constraint per request (a 400 names both). `check_spec` compiles the grammar
without a vocabulary (a 400 naming what is wrong); the endpoint runs it in a worker thread
unless its result is cached, so a large schema never holds the event loop, and it runs
before the request reaches the backend (no KV is allocated for a grammar that fails).
"""
from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict

from xllm_py.api.errors import InvalidRequestError
from xllm_py.structured import grammar
from xllm_py.structured.spec import GrammarSpec, canonical_json

# Request fields that travel as the spec's text, not as values of their own (the wire
# checks of validation.py skip them).
STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex",
                     "guided_choice", "guided_grammar", "guided_whitespace_pattern",
                     "guided_decoding_backend", "tools", "tool_choice")
_BACKENDS = (None, "auto", "guidance", "llguidance")
_SO_KINDS = ("json", "regex", "choice", "grammar", "json_object")
_SO_OPTIONS = ("disable_any_whitespace", "whitespace_pattern", "disable_fallback")


class StructuredFields(BaseModel):
    """The structured-output fields of both endpoints (typed loosely: checked below)."""

    model_config = ConfigDict(extra="ignore")

    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_whitespace_pattern: Any = None
    guided_decoding_backend: Any = None

    def output_spec(self) -> GrammarSpec | None:
        """The request's constraint (400 on a malformed one), not yet compiled."""
        found = self._constraints()
        return found[0][1] if found else None

    def output_param(self) -> str:
        """The field the constraint came from (the `param` of its 400)."""
        found = self._constraints()
        return found[0][0] if found else "response_format"

    def _constraints(self) -> list[tuple[str, GrammarSpec]]:
        found: list[tuple[str, GrammarSpec]] = []
        rf = _response_format(self.response_format)
        if rf is not None:
            found.append(("response_format", rf))
        so = _structured_outputs(self.structured_outputs)
        if so is not None:
            found.append(("structured_outputs", so))
        _check_backend(self.guided_decoding_backend)
        ws = self.guided_whitespace_pattern
        if ws is not None and not isinstance(ws, str):
            raise InvalidRequestError("guided_whitespace_pattern must be a string",
                                      param="guided_whitespace_pattern")
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"),
                           ("guided_choice", "choice"), ("guided_grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                found.append((name, _spec(kind, value, name, ws)))
        if len(found) > 1:
            raise InvalidRequestError(
                f"only one structured output may be given; got {found[0][0]} and {found[1][0]}",
                param=found[1][0])
        return found


def check_spec(spec: GrammarSpec, param: str = "response_format") -> None:
    """400 naming the problem if the grammar cannot run (a compile without vocabulary;
    cached by spec, so call it off the event loop unless grammar.is_checked(spec))."""
    problem = grammar.check(spec)
    if problem is not None:
        raise InvalidRequestError(problem, param=param)


def _response_format(rf: Any) -> GrammarSpec | None:
    if rf is None:
        return None
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise InvalidRequestError(
            "response_format must be an object with a type (text, json_object or json_schema)",
            param="response_format")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise InvalidRequestError("response_format.json_schema must be an object with a "
                                      "schema", param="response_format.json_schema")
        schema = js.get("schema", {"type": "object"})
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError("response_format.json_schema.schema must be a JSON "
                                      "schema object", param="response_format.json_schema.schema")
        return GrammarSpec.json_schema(schema)
    raise InvalidRequestError(
        f"response_format type must be text, json_object or json_schema, got {kind!r}",
        param="response_format.type")


def _structured_outputs(so: Any) -> GrammarSpec | None:
    if so is None:
        return None
    if not isinstance(so, dict):
        raise InvalidRequestError("structured_outputs must be an object",
                                  param="structured_outputs")
    unknown = [k for k in so if k not in _SO_KINDS + _SO_OPTIONS and so[k] is not None]
    if unknown:
        raise InvalidRequestError(
            f"structured_outputs.{unknown[0]} is not supported by this server",
            param=f"structured_outputs.{unknown[0]}")
    kinds = [k for k in _SO_KINDS if so.get(k) not in (None, False)]
    if len(kinds) != 1:
        raise InvalidRequestError(
            "structured_outputs must set exactly one of " + ", ".join(_SO_KINDS)
            + (f" (got {', '.join(kinds)})" if kinds else ""), param="structured_outputs")
    ws = so.get("whitespace_pattern")
    if ws is not None and not isinstance(ws, str):
        raise InvalidRequestError("structured_outputs.whitespace_pattern must be a string",
                                  param="structured_outputs.whitespace_pattern")
    if so.get("disable_any_whitespace"):
        ws = ""
    kind = kinds[0]
    if kind == "json_object":
        return GrammarSpec("json_object", "", ws)
    return _spec(kind, so[kind], f"structured_outputs.{kind}", ws)


def _spec(kind: str, value: Any, param: str, ws: str | None) -> GrammarSpec:
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise InvalidRequestError(f"{param} is not valid JSON: {e}", param=param) from None
        if not isinstance(value, (dict, bool)):
            raise InvalidRequestError(f"{param} must be a JSON schema object", param=param)
        return GrammarSpec("json", canonical_json(value), ws)
    if kind == "choice":
        if (not isinstance(value, list) or not value
                or not all(isinstance(v, str) and v for v in value)):
            raise InvalidRequestError(f"{param} must be a non-empty list of non-empty strings",
                                      param=param)
        return GrammarSpec.choices(value)
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"{param} must be a non-empty string", param=param)
    return GrammarSpec(kind, value)


def _check_backend(backend: Any) -> None:
    if backend not in _BACKENDS:
        raise InvalidRequestError(
            f"guided_decoding_backend {backend!r} is not available: this server decodes "
            "with llguidance (auto, guidance, llguidance)", param="guided_decoding_backend")
