"""EngineGrammars: structured outputs in the engine loop (engine thread only, no torch).

  intake   `defer`: a request whose grammar is not compiled yet waits off the loop while
           a worker thread compiles it (GrammarCompiler.prepare), then is added again
           (`take_deferred`); an abort meanwhile drops it. `attach` gives each sequence
           its own matcher and replays the tokens it already has (migration: the
           generated tokens in its prompt). A PD decode (`add_remote`) only starts the
           compile (`prepare_remote`); the matcher is attached when the first tokens
           come (`replay_remote`: whether they match; RemoteKV acts on the answer).
  step     `mask`: the bitmasks of the batch's constrained rows (None when it has none:
           an unconstrained batch does no mask work at all); a speculating sequence's
           guess rows each under its grammar's state at that guess.
  after    `advance`: every accepted token goes into its sequence's matcher; a grammar
           that is complete ends the sequence (finish_reason stop).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

from xllm_py.request import Request, RequestStatus
from xllm_py.structured.compiler import (
    GrammarCompiler, SequenceGrammar, TokenMask, fill_bitmask, fill_guess_bitmask)
from xllm_py.structured.spec import GrammarSpec

logger = logging.getLogger(__name__)


class EngineGrammars:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._args = (tokenizer, vocab_size, list(eos_token_ids))
        self._compiler: GrammarCompiler | None = None
        self._deferred: dict[str, Any] = {}  # request id -> EngineRequest
        self._remote: dict[str, tuple[GrammarSpec, list[int]]] = {}  # child id -> (spec, replay)
        self._bitmask: Any = None

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            self._compiler = GrammarCompiler(*self._args)
        return self._compiler

    # -- intake -------------------------------------------------------------------------
    def defer(self, req: Any, resubmit: Callable[[Any], None]) -> bool:
        """True if `req` waits for its grammar's compile; `resubmit(req)` runs (on the
        compile thread) when it is done."""
        spec = req.params.structured
        if spec is None:
            return False
        fut = self.compiler.prepare(spec)
        if fut.done():
            return False
        self._deferred[req.request_id] = req
        fut.add_done_callback(lambda _f: resubmit(req))
        return True

    def take_deferred(self, request_id: str) -> bool:
        """The compile is done: True if the request is still wanted (not aborted)."""
        return self._deferred.pop(request_id, None) is not None

    def drop_deferred(self, request_id: str) -> bool:
        return self._deferred.pop(request_id, None) is not None

    def attach(self, requests: Sequence[Request], spec: GrammarSpec,
               replay: Sequence[int] = ()) -> str | None:
        """A matcher for each sequence, `replay` consumed; why not, or None."""
        for request in requests:
            grammar = self.compiler.matcher(spec)
            if isinstance(grammar, str):
                return grammar
            if replay and grammar.advance(replay) and grammar.problem:
                return f"the tokens generated so far do not match the grammar ({grammar.problem})"
            request.grammar = grammar
        return None

    def attach_new(self, requests: list[Request], req: Any, outputs: Any) -> list[Request] | str:
        """`attach` for an admitted EngineRequest: its sequences, or why not (its outputs
        dropped then)."""
        problem = self.attach(requests, req.params.structured, generated_tokens(req))
        if problem is None:
            return requests
        outputs.drop_parent(req.request_id)
        return problem

    def prepare_remote(self, request: Request, req: Any) -> str | None:
        """PD decode (EngineRequest `req`, its sequence `request`): start the compile;
        the matcher comes with the first tokens. Why it cannot run, or None."""
        spec = req.params.structured
        if spec is None:
            return None
        fut = self.compiler.prepare(spec)
        if fut.done() and isinstance(fut.result(), str):
            return fut.result()
        self._remote[request.request_id] = (spec, generated_tokens(req))
        return None

    def replay_remote(self, request: Request, first_token_ids: Sequence[int]) -> str | None:
        """The prefill's first tokens came for `request` (running now): attach its matcher
        (waiting for the compile if it still runs) and replay them. Whether they match:
        None (they do, or the request has no grammar), "stop" (they complete the
        grammar), or why they do not fit it."""
        entry = self._remote.pop(request.request_id, None)
        if entry is None:
            return None
        spec, replay = entry
        problem = self.attach([request], spec, replay)
        if problem is not None:
            return problem
        grammar = request.grammar
        if grammar.advance(first_token_ids):  # type: ignore[union-attr]
            return grammar.problem or "stop"  # type: ignore[union-attr]
        return None

    def forget_remote(self, request_id: str) -> None:
        """A PD decode that ended before its grammar was attached."""
        self._remote.pop(request_id, None)

    # -- step ---------------------------------------------------------------------------
    def mask(self, requests: Sequence[Request],
             guesses: Sequence[tuple[Request, Sequence[int]]] = ()) -> TokenMask | None:
        """The masks of a logits batch: a row per request of `requests` (at its last known
        token), then per (request, its guesses) of `guesses` a row per guess, masked by
        the grammar after the guesses up to it (the matcher itself is not advanced)."""
        rows = [i for i, r in enumerate(requests) if r.grammar is not None]
        spec: list[tuple[int, SequenceGrammar, Sequence[int]]] = []
        first = len(requests)
        for request, drafts in guesses:
            if request.grammar is not None and drafts:
                spec.append((first, request.grammar, drafts))
            first += len(drafts)
        if not rows and not spec:
            return None
        import numpy as np

        num_rows = len(rows) + sum(len(d) for _, _, d in spec)
        words = (self.compiler.ll_tokenizer.vocab_size + 31) // 32
        if self._bitmask is None or self._bitmask.shape[0] < num_rows \
                or self._bitmask.shape[1] != words:
            self._bitmask = np.zeros((max(num_rows, 8), words), dtype=np.int32)
        bitmask = self._bitmask[:num_rows]
        if rows:
            fill_bitmask(self.compiler, [requests[i].grammar for i in rows], bitmask)
        for first, grammar, drafts in spec:
            fill_guess_bitmask(grammar, drafts, bitmask[len(rows):])
            rows.extend(range(first, first + len(drafts)))
        return TokenMask(rows, bitmask)

    def advance(self, updates: Sequence[Any], scheduler: Any) -> None:
        """Feed each live constrained request's new tokens to its matcher; end the ones
        whose grammar is complete (the update then says finished, "stop")."""
        for upd in updates:
            if upd.finished or not upd.new_token_ids:
                continue
            request = scheduler.requests.get(upd.request_id)
            grammar: SequenceGrammar | None = getattr(request, "grammar", None)
            if grammar is None or not grammar.advance(upd.new_token_ids):
                continue
            if grammar.problem:
                logger.warning("request %s: %s; ending it", upd.request_id, grammar.problem)
            scheduler.finish_request(upd.request_id, RequestStatus.FINISHED_STOPPED)
            upd.finished, upd.finish_reason = True, "stop"

    def close(self) -> None:
        if self._compiler is not None:
            self._compiler.close()


def generated_tokens(req: Any) -> list[int]:
    """The generated tokens at the end of a migrated request's prompt (EngineRequest
    generated_offset: its grammar replays them); none for a new request."""
    k = req.generated_offset
    return list(req.prompt_token_ids[len(req.prompt_token_ids) - k:]) if k else []
