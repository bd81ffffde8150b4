"""Speculative decoding's configuration (engine/spec_decode/), parsed from the engine's
--speculative-config value; a module of its own so the engine's settings stay readable."""
from __future__ import annotations

import dataclasses
import json


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (engine/spec_decode/), as vLLM's --speculative-config spells
    it. "ngram": prompt lookup of the last prompt_lookup_max..min tokens. "suffix"
    (suffix.py): the last up to max_tree_depth tokens looked up in the sequence and the
    last max_cached_requests outputs; the continuation most places share while likely."""

    METHODS = ("ngram", "suffix")
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_min_token_prob: float = 0.1
    suffix_decoding_max_spec_factor: float = 1.0
    # Guesses a step verifies, as the step's price says they pay (spec_decode/step_cost.py);
    # false: every guess the method finds (fixed-length speculation, what a measurement of
    # a method's acceptance wants).
    cost_aware: bool = True

    # At most this many guesses a step: a verify chunk below 16 tokens stays on the decode
    # step's paged kernel (model/attention.py DENSE_CHUNK_MIN_TOKENS): the same logits.
    MAX_TOKENS = 15

    def __post_init__(self) -> None:
        for ok, message in (
                (self.method in self.METHODS, f"method must be one of {self.METHODS}"),
                (1 <= self.num_speculative_tokens <= self.MAX_TOKENS,
                 f"num_speculative_tokens must be in 1..{self.MAX_TOKENS}"),
                (1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
                 "need 1 <= prompt_lookup_min <= prompt_lookup_max"),
                (self.suffix_decoding_max_tree_depth >= 1
                 and self.suffix_decoding_max_cached_requests >= 0,
                 "need suffix_decoding_max_tree_depth >= 1, _max_cached_requests >= 0"),
                (0 <= self.suffix_decoding_min_token_prob <= 1
                 and self.suffix_decoding_max_spec_factor > 0,
                 "need suffix_decoding_min_token_prob in [0, 1], _max_spec_factor > 0"),
                (isinstance(self.cost_aware, bool), "cost_aware must be true or false")):
            if not ok:
                raise ValueError(f"speculative_config: {message}, got {self}")

    @classmethod
    def parse(cls, text: str | None) -> "SpeculativeConfig | None":
        """A speculative_config value: JSON of these fields, or off / none / empty."""
        if text is None or text.strip().lower() in ("", "off", "none", "null"):
            return None
        try:
            fields = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"speculative_config is not JSON: {exc}") from None
        if not isinstance(fields, dict):
            raise ValueError("speculative_config must be a JSON object or 'off'")
        known = {f.name for f in dataclasses.fields(cls)}
        if unknown := sorted(set(fields) - known):
            raise ValueError(f"speculative_config: unknown fields {unknown}")
        return cls(**fields)


# What an engine process speculates with unless told otherwise: n-gram prompt lookup (a
# 2-4 token match, 4 guesses), priced per step. benchmarks/bench_spec.py, each engine fresh:
# no slower than none at concurrency 1 to 16 on repetitive and open text (where a guess
# does not pay, none is verified); suffix decoding, as fast at 1 to 4, fell below none on
# repetitive text at 16 (its tree's upkeep on the step's thread).
DEFAULT = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_max=4,
                            prompt_lookup_min=2)
