"""Per-request output state on the engine thread: text deltas, stop strings, n/best_of.

Stages of a parent request (one client request, n or best_of sequences):
  add_parent -> per step: process(update) per sequence -> deltas grouped per parent ->
  RequestOutput to the parent's sink -> finished when every sequence finished.
Sequences are scheduled as independent requests `<parent>#<index>`; their prompt blocks
are shared through the prefix cache. A sink with `final_only` set (a non-streaming client)
gets the first output that carries tokens (it stamps the time to first token) and then one
output at the end: the deltas in between are held here, not built into an output a step.
Prompt logprobs (wanted at add_parent): every sequence of the parent scores the prompt
during its prefill (add_prompt_logprobs, chunk by chunk); the first sequence to produce
an output hands its complete list to the parent, which sends it with its first output.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, Protocol

from xllm_py.engine.detokenizer import IncrementalDetokenizer, StopChecker
from xllm_py.outputs import CompletionDelta, RequestOutput, TokenLogprob

logger = logging.getLogger(__name__)


class OutputSink(Protocol):
    def emit(self, output: RequestOutput) -> None: ...
    # Optional attribute `final_only: bool` (see the module docstring).


def child_id(parent_id: str, index: int) -> str:
    return f"{parent_id}#{index}"


def parent_of(request_id: str) -> tuple[str, int]:
    parent, _, index = request_id.rpartition("#")
    return parent, int(index)


@dataclasses.dataclass
class _SeqState:
    index: int
    detokenizer: IncrementalDetokenizer
    stop_checker: StopChecker
    want_logprobs: bool
    num_tokens: int = 0
    cumulative_logprob: float = 0.0
    finished: bool = False
    # best_of buffers the whole sequence until the end.
    text: list[str] = dataclasses.field(default_factory=list)
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    # Filled during the prefill when the parent wants prompt logprobs; None afterwards.
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclasses.dataclass
class _ParentState:
    request_id: str
    sink: OutputSink
    prompt_token_ids: list[int]
    n: int
    seqs: dict[int, _SeqState]
    buffered: bool  # best_of > n: emit only the n best at the end
    num_cached_tokens: int = 0
    predicted: tuple[int, int] = (0, 0)  # a prediction's guessed tokens kept, not kept
    sent_first: bool = False
    # A migrated request (MultiGenerations): its prompt here includes tokens generated
    # elsewhere; usage reports the client's prompt and counts those tokens as generated.
    num_prompt_tokens: int | None = None
    generated_offset: int = 0
    arrival_time: float = 0.0  # time.monotonic() at arrival, for TTFT
    final_only: bool = False  # the sink wants the first tokens and the end only
    sent_tokens: bool = False
    held: list[CompletionDelta] = dataclasses.field(default_factory=list)
    # A sequence's complete prompt logprobs, until the first output carries them.
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs.values())

    @property
    def num_generated(self) -> int:
        return self.generated_offset + sum(s.num_tokens for s in self.seqs.values())

    @property
    def usage_prompt_tokens(self) -> int:
        return (self.num_prompt_tokens if self.num_prompt_tokens is not None
                else len(self.prompt_token_ids))


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._parents: dict[str, _ParentState] = {}

    def __contains__(self, parent_id: str) -> bool:
        return parent_id in self._parents

    def add_parent(self, request_id: str, prompt_token_ids: list[int], sink: OutputSink, *,
                   n: int, best_of: int, stop: list[str], include_stop_str: bool,
                   skip_special_tokens: bool, want_logprobs: bool,
                   first_index: int = 0, num_prompt_tokens: int | None = None,
                   generated_offset: int = 0, num_unread: int | None = None,
                   arrival_time: float = 0.0, want_prompt_logprobs: bool = False) -> None:
        seqs = {}
        for i in range(first_index, first_index + best_of):
            detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids,
                                                 skip_special_tokens=skip_special_tokens,
                                                 num_generated=generated_offset,
                                                 num_unread=num_unread)
            stop_checker = StopChecker(stop, include_stop_str)
            if generated_offset and stop:  # resumed: the text emitted before still counts
                end = len(prompt_token_ids) - detokenizer.num_unread
                stop_checker.resume(self.tokenizer.decode(
                    prompt_token_ids[len(prompt_token_ids) - generated_offset:end],
                    skip_special_tokens=skip_special_tokens))
            seqs[i] = _SeqState(index=i, detokenizer=detokenizer, stop_checker=stop_checker,
                                want_logprobs=want_logprobs)
            if want_prompt_logprobs:
                seqs[i].prompt_logprobs = [None] * len(prompt_token_ids)
        self._parents[request_id] = _ParentState(
            request_id=request_id, sink=sink, prompt_token_ids=list(prompt_token_ids), n=n,
            seqs=seqs, buffered=best_of > n, num_prompt_tokens=num_prompt_tokens,
            generated_offset=generated_offset, sent_first=num_prompt_tokens is not None,
            arrival_time=arrival_time, final_only=bool(getattr(sink, "final_only", False)))

    def set_usage(self, parent_id: str, num_cached: int,
                  predicted: tuple[int, int] | None = None) -> None:
        """Usage beyond the token counts: the prefix-cache hit, a prediction's guesses."""
        state = self._parents.get(parent_id)
        if state is not None:
            state.num_cached_tokens = max(state.num_cached_tokens, num_cached)
            if predicted is not None:
                state.predicted = predicted

    def add_prompt_logprobs(self, request_id: str, first_token: int,
                            entries: list[TokenLogprob]) -> None:
        """Record the logprobs of prompt tokens first_token .. first_token + len - 1 of one
        sequence (a prefill chunk's; a recompute after preemption writes them again)."""
        parent_id, index = parent_of(request_id)
        parent = self._parents.get(parent_id)
        seq = parent.seqs.get(index) if parent is not None else None
        if seq is None or seq.prompt_logprobs is None:
            return
        if first_token < 1 or first_token + len(entries) > len(seq.prompt_logprobs):
            raise ValueError(f"prompt logprobs for tokens {first_token}.."
                             f"{first_token + len(entries) - 1} outside the prompt of "
                             f"{len(seq.prompt_logprobs)} tokens")
        seq.prompt_logprobs[first_token:first_token + len(entries)] = entries

    def process(self, request_id: str, new_token_ids: list[int],
                logprobs: list[TokenLogprob | None] | None, finish_reason: str | None,
                stop_reason: str | int | None,
                finish: Callable[[str, str], None]) -> CompletionDelta | None:
        """Turn one sequence's new tokens into a delta. Calls finish(request_id, stop_str)
        when a stop string ends the sequence (the scheduler must then stop it)."""
        parent_id, index = parent_of(request_id)
        parent = self._parents.get(parent_id)
        if parent is None or index not in parent.seqs:
            return None
        seq = parent.seqs[index]
        if seq.finished:
            return None
        if seq.prompt_logprobs is not None:  # its prefill is done: the list is complete
            if parent.prompt_logprobs is None:
                parent.prompt_logprobs = seq.prompt_logprobs
            seq.prompt_logprobs = None
        if len(new_token_ids) > 1 and seq.stop_checker.has_stop_strings:
            emit, stop_str, new_token_ids = _until_stop_string(seq, new_token_ids)
            if logprobs is not None:  # (one per token: those after the stop are not emitted)
                logprobs = logprobs[:len(new_token_ids)]
        else:
            text = seq.detokenizer.add_tokens(new_token_ids) if new_token_ids else ""
            emit, stop_str = seq.stop_checker.add(text)
        seq.num_tokens += len(new_token_ids)
        if stop_str is not None:
            finish(request_id, stop_str)
            finish_reason, stop_reason = "stop", stop_str
        elif finish_reason is not None:
            tail, stop_str = seq.stop_checker.add(seq.detokenizer.flush())
            emit += tail
            if stop_str is not None:
                finish_reason, stop_reason = "stop", stop_str
            else:
                emit += seq.stop_checker.flush()
        lps = None
        if logprobs is not None:
            for lp in logprobs:
                if lp is not None:
                    seq.cumulative_logprob += lp.logprob
            if seq.want_logprobs:
                lps = [lp for lp in logprobs if lp is not None]
        delta = CompletionDelta(index=index, text=emit, token_ids=list(new_token_ids),
                                logprobs=lps, finish_reason=finish_reason,
                                stop_reason=stop_reason)
        if finish_reason is not None:
            seq.finished = True
            seq.finish_reason, seq.stop_reason = finish_reason, stop_reason
        return delta

    def emit_step(self, deltas: list[CompletionDelta], parent_id: str) -> float | None:
        """Send one step's deltas of a parent. Returns its TTFT (s) on its first output."""
        parent = self._parents.get(parent_id)
        if parent is None:
            return None
        if parent.buffered:
            for d in deltas:
                seq = parent.seqs[d.index]
                seq.text.append(d.text)
                seq.token_ids.extend(d.token_ids)
                if d.logprobs:
                    seq.logprobs.extend(d.logprobs)
            if not parent.finished:
                return None
            best = sorted(parent.seqs.values(), key=lambda s: s.cumulative_logprob,
                          reverse=True)[: parent.n]
            deltas = [CompletionDelta(index=i, text="".join(s.text), token_ids=s.token_ids,
                                      logprobs=s.logprobs if s.want_logprobs else None,
                                      finish_reason=s.finish_reason, stop_reason=s.stop_reason)
                      for i, s in enumerate(best)]
        elif parent.final_only:
            if parent.sent_tokens and not parent.finished:
                parent.held.extend(deltas)
                return None
            if parent.held:
                deltas, parent.held = merge_deltas(parent.held + deltas), []
            parent.sent_tokens = any(d.token_ids or d.text for d in deltas)
        finished = parent.finished
        out = RequestOutput(
            request_id=parent_id, outputs=deltas, finished=finished,
            num_prompt_tokens=parent.usage_prompt_tokens,
            num_generated_tokens=parent.num_generated,
            num_cached_tokens=parent.num_cached_tokens,
            num_accepted_prediction_tokens=parent.predicted[0],
            num_rejected_prediction_tokens=parent.predicted[1],
            prompt_token_ids=None if parent.sent_first else parent.prompt_token_ids,
            prompt_logprobs=None if parent.sent_first else parent.prompt_logprobs)
        ttft = None if parent.sent_first or not parent.arrival_time else (
            time.monotonic() - parent.arrival_time)
        parent.sent_first = True
        parent.prompt_logprobs = None
        if finished:
            del self._parents[parent_id]
        try:
            parent.sink.emit(out)
        except Exception:  # a broken sink must not take the engine loop down
            logger.exception("output sink of request %s failed", parent_id)
        return ttft

    def fail_parent(self, parent_id: str, code: int, message: str) -> None:
        parent = self._parents.pop(parent_id, None)
        if parent is None:
            return
        out = RequestOutput(request_id=parent_id, finished=True,
                            num_prompt_tokens=parent.usage_prompt_tokens,
                            num_generated_tokens=parent.num_generated,
                            error_code=code, error_message=message)
        try:
            parent.sink.emit(out)
        except Exception:
            logger.exception("output sink of request %s failed", parent_id)

    def drop_parent(self, parent_id: str) -> _ParentState | None:
        return self._parents.pop(parent_id, None)

    def child_ids(self, parent_id: str) -> list[str]:
        parent = self._parents.get(parent_id)
        if parent is None:
            return []
        return [child_id(parent_id, i) for i in parent.seqs]


def merge_deltas(deltas: list[CompletionDelta]) -> list[CompletionDelta]:
    """One delta per choice index (in order of first appearance) that concatenates the
    given deltas of that choice; the last finish reason wins."""
    merged: dict[int, CompletionDelta] = {}
    texts: dict[int, list[str]] = {}
    for d in deltas:
        m = merged.get(d.index)
        if m is None:
            m = merged[d.index] = CompletionDelta(index=d.index, token_ids=[])
            texts[d.index] = []
        texts[d.index].append(d.text)
        m.token_ids.extend(d.token_ids)
        if d.logprobs is not None:
            if m.logprobs is None:
                m.logprobs = []
            m.logprobs.extend(d.logprobs)
        if d.finish_reason is not None:
            m.finish_reason, m.stop_reason = d.finish_reason, d.stop_reason
    for index, m in merged.items():
        m.text = "".join(texts[index])
    return list(merged.values())


def _until_stop_string(seq, token_ids: list[int]) -> tuple[str, str | None, list[int]]:
    """Several tokens of one step (a speculative one), one at a time, so that a stop string
    ends them where it ends, as it would one token a step: (text, stop string, tokens)."""
    emit = ""
    for n in range(len(token_ids)):
        part, stop_str = seq.stop_checker.add(seq.detokenizer.add_tokens(token_ids[n:n + 1]))
        emit += part
        if stop_str is not None:
            return emit, stop_str, token_ids[:n + 1]
    return emit, None, token_ids
