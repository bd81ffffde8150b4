"""Guesses from OpenAI's Predicted Outputs: the request's `prediction` (tokenized text the
output is expected to repeat, e.g. the file an edit rewrites). Where the output's last n
tokens (n from MAX_MATCH down to 1) occur in the prediction, propose what follows there;
with no output yet, the prediction's start.

An n-gram occurs many times in a long text (indentation, common words), so each keeps all
its positions and the match nearest after the last one is taken: an edit copies the
prediction in order, with insertions and deletions between. Pure Python: no torch.
"""
from __future__ import annotations

import bisect

# The longest suffix of the output looked up (a longer one is no better located; the index
# holds every n-gram up to this length).
MAX_MATCH = 4


class PredictionLookup:
    """One request's prediction, indexed once."""

    def __init__(self, prediction: list[int], max_match: int = MAX_MATCH) -> None:
        self.prediction = list(prediction)
        self.max_match = max_match
        # n-gram -> ascending positions right after its occurrences (something follows)
        self._after: dict[tuple[int, ...], list[int]] = {}
        self._cursor = 0  # where the last guess was taken from
        tokens = self.prediction
        for end in range(1, len(tokens)):
            for n in range(1, min(max_match, end) + 1):
                self._after.setdefault(tuple(tokens[end - n:end]), []).append(end)

    def propose(self, output: list[int], k: int) -> list[int]:
        """Up to `k` tokens of the prediction that follow where `output` ends in it."""
        if k <= 0 or not self.prediction:
            return []
        if not output:
            return self.prediction[:k]
        for n in range(min(self.max_match, len(output)), 0, -1):
            positions = self._after.get(tuple(output[-n:]))
            if positions:
                i = bisect.bisect_left(positions, self._cursor)
                self._cursor = positions[i] if i < len(positions) else positions[0]
                return self.prediction[self._cursor:self._cursor + k]
        return []
