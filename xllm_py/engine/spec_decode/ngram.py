"""N-gram prompt lookup (vLLM's "ngram" method): find the sequence's last n tokens
(n from prompt_lookup_max down to prompt_lookup_min) earlier in its prompt and output,
and propose the tokens that followed their first occurrence.

The index is incremental: each n-gram is entered once, with the position after its first
occurrence, so a step costs what the tokens added since the last one cost, not the
length of the context. Pure Python: no torch.
"""
from __future__ import annotations


class NgramIndex:
    """One sequence's n-grams (its tokens only ever grow: rejected guesses never join)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self._first: dict[tuple[int, ...], int] = {}  # n-gram -> position after it
        self._indexed = 0  # n-grams ending before this position are in

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the longest earlier match of the last n tokens."""
        if k <= 0:
            return []
        self._extend(tokens)
        end = len(tokens)
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            pos = self._first.get(tuple(tokens[end - n:end]))
            if pos is not None:
                return tokens[pos:pos + k]
        return []

    def _extend(self, tokens: list[int]) -> None:
        """Enter the n-grams that have a following token (those ending before the last)."""
        first = self._first
        for end in range(max(self._indexed, self.min_n), len(tokens)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                first.setdefault(tuple(tokens[end - n:end]), end)
        self._indexed = max(self._indexed, len(tokens))
