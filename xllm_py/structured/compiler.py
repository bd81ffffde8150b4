"""The engine's grammars: llguidance matchers compiled against the engine's vocabulary,
and one matcher per constrained sequence (no torch here; token_mask.py applies masks).

GrammarCompiler (one per engine):
  - LLTokenizer built once, on first use, from the engine tokenizer's tokenizer.json
    (the model's logits width as its vocabulary; every EOS id of the model ends a grammar);
  - `prepare(spec)`: a future of the compiled template matcher, compiled on a worker
    thread (never on the engine loop or an event loop), cached by the spec's key (LRU);
  - `matcher(spec)`: a fresh matcher for one sequence (a copy of the template).
SequenceGrammar: one sequence's matcher; `advance(tokens)` after every accepted token;
`num_guessable(guesses)`: how many speculative guesses may be verified.
fill_bitmask: the masks of a batch's constrained rows in one call (in parallel, in Rust);
fill_guess_bitmask: the masks at each guess of one sequence (the matcher restored after).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
from collections import OrderedDict
from typing import Any, Sequence

from xllm_py.structured.grammar import GrammarError, to_llguidance
from xllm_py.structured.spec import GrammarSpec

logger = logging.getLogger(__name__)

_CACHE_SIZE = 256


@dataclasses.dataclass
class TokenMask:
    """The grammar masks of one logits batch (token_mask.apply_token_mask applies them)."""

    rows: list[int]  # logits rows with a constraint, ascending
    bitmask: Any  # numpy int32 [len(rows), ceil(V / 32)]: row i is rows[i]'s mask


class GrammarCompiler:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._lock = threading.Lock()
        self._ll_tokenizer: Any = None
        self._executor: Any = None
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="xllm-grammar")
        self._templates: OrderedDict[tuple, concurrent.futures.Future] = OrderedDict()

    # -- compile ------------------------------------------------------------------------
    def prepare(self, spec: GrammarSpec) -> concurrent.futures.Future:
        """The compiled template of `spec` (a future: done at once when cached). Its
        result is an LLMatcher, or a str saying why the grammar cannot run."""
        with self._lock:
            fut = self._templates.get(spec.key)
            if fut is not None:
                self._templates.move_to_end(spec.key)
                return fut
            fut = self._pool.submit(self._compile, spec)
            self._templates[spec.key] = fut
            while len(self._templates) > _CACHE_SIZE:
                self._templates.popitem(last=False)
            return fut

    def matcher(self, spec: GrammarSpec) -> "SequenceGrammar | str":
        """A matcher for one sequence (waits for the compile if it is still running)."""
        template = self.prepare(spec).result()
        if isinstance(template, str):
            return template
        return SequenceGrammar(template.deep_copy())

    def _compile(self, spec: GrammarSpec) -> Any:
        import llguidance as llg

        try:
            grammar = to_llguidance(spec)
        except GrammarError as e:
            return str(e)
        matcher = llg.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            return f"invalid {spec.kind}: {matcher.get_error()[:400]}"
        return matcher

    @property
    def ll_tokenizer(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = build_ll_tokenizer(self._tokenizer, self.vocab_size,
                                                        self._eos)
            return self._ll_tokenizer

    @property
    def executor(self) -> Any:
        if self._executor is None:
            import llguidance as llg

            self._executor = llg.LLExecutor()
        return self._executor

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def build_ll_tokenizer(tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> Any:
    """LLTokenizer of the engine's tokenizer (xllm_py.model.tokenizer.Tokenizer: its
    `tokenizers` backend serialised; a transformers fast tokenizer: its backend)."""
    import llguidance as llg

    backend = getattr(tokenizer, "_tok", None) or getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "to_str"):
        raise GrammarError("structured outputs need a tokenizer.json tokenizer")
    eos = [t for t in eos_token_ids if 0 <= t < vocab_size] or None
    n_vocab = max(vocab_size, backend.get_vocab_size(with_added_tokens=True))
    return llg.LLTokenizer(backend.to_str(), n_vocab=n_vocab, eos_token=eos)


class SequenceGrammar:
    """One sequence's matcher. `advance` consumes its accepted tokens; `stopped` says the
    grammar is complete (the sequence ends with finish_reason stop); `problem` is set when
    a token was refused (never for a token the mask allowed)."""

    __slots__ = ("matcher", "problem")

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher
        self.problem: str | None = None

    def advance(self, token_ids: Sequence[int]) -> bool:
        """Consume `token_ids`; returns True if the grammar is now complete (or broken:
        see `problem`)."""
        for token_id in token_ids:
            if self.matcher.is_stopped():
                return True
            if not self.matcher.consume_token(int(token_id)):
                self.problem = f"the grammar refused token {token_id}"
                return True
        return self.matcher.is_stopped()

    @property
    def stopped(self) -> bool:
        return self.matcher.is_stopped()

    def num_guessable(self, token_ids: Sequence[int]) -> int:
        """How many of `token_ids`, from the first, may be verified as speculative guesses:
        each one allowed after those before it, and none completing the grammar (the
        token that completes it ends the sequence: nothing may follow it in the step, so
        it is left to the model's own token at its row). The matcher is left as it was."""
        tokens = [int(t) for t in token_ids]
        n = self.matcher.validate_tokens(tokens) if not self.matcher.is_stopped() else 0
        for i in range(n):
            self.matcher.consume_token(tokens[i])
            if self.matcher.is_stopped():
                self.matcher.rollback(i + 1)
                return i
        self.matcher.rollback(n)
        return n


def fill_bitmask(compiler: GrammarCompiler, grammars: Sequence[SequenceGrammar],
                 bitmask: Any) -> None:
    """Row i of `bitmask` (numpy int32 [>= len, ceil(V/32)], C-contiguous) <- the allowed
    tokens of grammars[i] (bit t of word t // 32)."""
    import llguidance.numpy as lln

    pairs = [(g.matcher, i) for i, g in enumerate(grammars)]
    if len(pairs) == 1:
        lln.fill_next_token_bitmask(pairs[0][0], bitmask, 0)
    else:
        lln.fill_next_token_bitmask_par(compiler.executor, pairs, bitmask)


def fill_guess_bitmask(grammar: SequenceGrammar, guesses: Sequence[int], bitmask: Any) -> None:
    """Row j of `bitmask` (numpy int32 [>= len(guesses), ceil(V/32)], C-contiguous) <- the
    tokens `grammar` allows after guesses[:j + 1] (the row of the model's token after
    guess j), for guesses it accepts (`num_guessable`); the matcher is restored after."""
    import llguidance.numpy as lln

    matcher = grammar.matcher
    consumed = 0
    try:
        for j, token_id in enumerate(guesses):
            if not matcher.consume_token(int(token_id)):
                raise ValueError(f"the grammar refused guess {token_id}")
            consumed += 1
            lln.fill_next_token_bitmask(matcher, bitmask, j)
    finally:
        matcher.rollback(consumed)
