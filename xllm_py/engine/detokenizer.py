"""Output text of a request: token ids -> text deltas -> stop strings.

Per request, per step:
  1. IncrementalDetokenizer.add_tokens(new_ids) -> text delta, never ending in half a
     UTF-8 character (byte-level BPE tokens can split one); flush() at the end.
  2. StopChecker.add(delta) -> (text safe to emit, matched stop string or None); it holds
     back a tail that may be the start of a stop string; flush() releases it at the end.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

logger = logging.getLogger(__name__)

_REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded before the output, so that the first output token is decoded in
# context (e.g. the leading space of SentencePiece tokens).
_NUM_CONTEXT_TOKENS = 5


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Decodes a growing list of output tokens into text deltas.

    Decodes only a sliding window: `_prefix_offset` is where the window starts,
    `_read_offset` is where the text already emitted ends. The delta is the text of the
    window beyond the text of [prefix, read); it is held back while it ends in U+FFFD
    (an incomplete character). The concatenation of all deltas (plus flush()) equals
    `tokenizer.decode(output_ids)` for byte-level tokenizers.
    """

    def __init__(self, tokenizer: Decoder, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True, num_generated: int = 0,
                 num_unread: int | None = None) -> None:
        """`num_generated`: how many of the prompt's last tokens are output that was
        generated elsewhere (a request resumed after migration); `num_unread`: how many of
        those the client has no text for yet (held back there: an incomplete character).
        Their text is emitted here, with the next delta. Without `num_unread` it is
        inferred: the generated tokens after the last point where the text was whole
        (exact when every step made one token)."""
        if not callable(getattr(tokenizer, "decode", None)):
            raise ValueError(f"tokenizer must have a decode(ids, skip_special_tokens) method, "
                             f"got {type(tokenizer).__name__}")
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        ids = list(prompt_token_ids)
        num_generated = max(0, min(num_generated, len(ids)))
        generated = ids[len(ids) - num_generated:]
        # The prompt context must end on a whole character, or its trailing U+FFFD would
        # swallow the first output character: prompt tokens past that point are dropped.
        context = ids[:len(ids) - num_generated][-_NUM_CONTEXT_TOKENS:]
        while context and self._decode(context).endswith(_REPLACEMENT_CHAR):
            context.pop()
        if num_unread is None:
            num_unread = self._count_unread(context, generated)
        self.num_unread = max(0, min(num_unread, num_generated))
        num_read = num_generated - self.num_unread
        if num_read:  # the window restarts inside the generated text, at a whole character
            first = max(0, num_read - _NUM_CONTEXT_TOKENS)
            context, read = generated[first:], num_read - first
        else:
            context, read = context + generated, len(context)
        self._token_ids: list[int] = context
        self._num_context_tokens = len(context)
        self._prefix_offset = 0
        self._read_offset = read
        self.output_text = ""

    def _count_unread(self, context: list[int], generated: list[int]) -> int:
        """Generated tokens after the last point where the text ended on a whole character."""
        ids = context + generated
        end = len(ids)
        while end > len(context) and self._decode(
                ids[max(0, end - _NUM_CONTEXT_TOKENS):end]).endswith(_REPLACEMENT_CHAR):
            end -= 1
        return len(ids) - end

    @property
    def output_token_ids(self) -> list[int]:
        return self._token_ids[self._num_context_tokens:]

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        """Appends new output tokens; returns the new text ("" while a character is incomplete)."""
        self._token_ids.extend(token_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """Returns text held back at the end of the request (an incomplete character)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self._read_offset == len(self._token_ids):
            return ""
        prefix_text = self._decode(self._token_ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._token_ids[self._prefix_offset:])
        incomplete = not final and new_text.endswith(_REPLACEMENT_CHAR)
        if len(new_text) <= len(prefix_text) or incomplete:
            return ""
        delta = new_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        self.output_text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)


class StopChecker:
    """Finds stop strings in a stream of text deltas, also across delta boundaries.

    The match that completes first wins (the earliest end; on a tie, the longest), so the
    result does not depend on how the text is split into deltas. Nothing after a stop
    string is ever emitted.
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        if isinstance(stop, str):
            raise ValueError("stop must be a list of strings, not a string")
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError("stop strings must be non-empty strings")
        self._stop = list(dict.fromkeys(stop))
        self._include = include_stop_str_in_output
        self._max_hold = max((len(s) for s in self._stop), default=1) - 1
        self._pending = ""
        self.stop_reason: str | None = None

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    @property
    def has_stop_strings(self) -> bool:
        return bool(self._stop)

    def add(self, delta: str) -> tuple[str, str | None]:
        """Returns (text safe to emit now, matched stop string or None).

        After a match, later calls return ("", None).
        """
        if self.stopped:
            return "", None
        if not self._stop:
            return delta, None
        text = self._pending + delta
        best: tuple[int, int, str] | None = None  # (end, -len, stop)
        for s in self._stop:
            start = text.find(s)
            if start >= 0:
                key = (start + len(s), -len(s), s)
                if best is None or key < best:
                    best = key
        if best is not None:
            end, _, s = best
            self._pending = ""
            self.stop_reason = s
            return (text[:end] if self._include else text[:end - len(s)]), s
        hold = self._hold_length(text)
        self._pending = text[len(text) - hold:] if hold else ""
        return text[:len(text) - hold], None

    def resume(self, text_so_far: str) -> None:
        """A request resumed elsewhere (migration) whose emitted text was `text_so_far`:
        hold back what the previous checker still held of it, as that one would have."""
        hold = self._hold_length(text_so_far) if self._stop else 0
        self._pending = text_so_far[len(text_so_far) - hold:] if hold else ""

    def flush(self) -> str:
        """Releases the held-back tail when the request ends without a stop string."""
        if self.stopped:
            return ""
        text, self._pending = self._pending, ""
        return text

    def _hold_length(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        for k in range(min(len(text), self._max_hold), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self._stop):
                return k
        return 0
