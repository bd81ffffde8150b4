"""Suffix decoding (vLLM's "suffix" method, after ArcticInference's SuffixDecoding): the
sequence's last tokens are looked up in its own tokens and in an engine-wide cache of
earlier requests' outputs; of the places they occur, the continuation most of them share
is proposed, token by token while its estimated probability stays above a cut-off.

The same answer a suffix tree of depth max_depth gives, kept as an index instead: each
token position is listed under the token at it, the match length of an occurrence is
counted backwards from there (up to max_depth), and the tree's counts along a path are
the numbers of occurrences that continue along it, counted when a proposal is made. A
position costs one list entry, not a tree node per substring (a pure-Python tree of
depth 24 over a thousand outputs would hold tens of millions of nodes).

A proposal tries the longest match lengths found (a longer one is more specific, a
shorter one has more occurrences to count) and keeps the one whose path has the largest
expected number of accepted tokens (the sum of the cumulative probabilities); the path
goes on while the cumulative probability is at least min_token_prob, and is at most
max_spec_factor x the match length long. Pure Python: no torch.
"""
from __future__ import annotations

import collections
import math

# Occurrences of a token looked at, the latest first (bounds a step's cost where a
# common token, a space or a newline, occurs thousands of times).
MAX_OCCURRENCES = 64
# Match lengths tried per proposal (the longest found first).
MAX_CANDIDATES = 4


class SuffixIndex:
    """Token sequences, each position listed under its token: (sequence id, position)."""

    def __init__(self) -> None:
        self.seqs: dict[object, list[int]] = {}
        self._at: dict[int, list[tuple[object, int]]] = collections.defaultdict(list)
        self._indexed: dict[object, int] = {}  # positions of a sequence listed so far
        self._num_entries = 0
        self._num_dropped = 0  # entries of removed sequences still in the lists

    def extend(self, seq_id: object, tokens: list[int]) -> None:
        """List the positions of `seq_id`'s tokens not listed yet (`tokens` only grows;
        the sequence is kept by reference)."""
        self.seqs[seq_id] = tokens
        start = self._indexed.get(seq_id, 0)
        at = self._at
        for pos in range(start, len(tokens)):
            at[tokens[pos]].append((seq_id, pos))
        self._num_entries += len(tokens) - start
        self._indexed[seq_id] = len(tokens)

    def remove(self, seq_id: object) -> None:
        """Forget a sequence; its entries go when the lists are next compacted."""
        if self.seqs.pop(seq_id, None) is not None:
            self._num_dropped += self._indexed.pop(seq_id)
            if self._num_dropped > self._num_entries // 2:
                self._compact()

    def _compact(self) -> None:
        live = self.seqs
        for token in list(self._at):
            kept = [e for e in self._at[token] if e[0] in live]
            if kept:
                self._at[token] = kept
            else:
                del self._at[token]
        self._num_entries -= self._num_dropped
        self._num_dropped = 0

    def occurrences(self, context: list[int], max_depth: int) -> list[tuple[int, list[int], int]]:
        """The latest places the context's last token occurs with something after it:
        (match length, sequence, position after the match)."""
        if not context:
            return []
        out = []
        entries = self._at.get(context[-1], ())
        for seq_id, pos in reversed(entries):
            tokens = self.seqs.get(seq_id)
            if tokens is None or pos + 1 >= len(tokens):
                continue
            n, limit = 1, min(max_depth, pos + 1, len(context))
            while n < limit and tokens[pos - n] == context[-1 - n]:
                n += 1
            out.append((n, tokens, pos + 1))
            if len(out) >= MAX_OCCURRENCES:
                break
        return out


def best_continuation(found: list[tuple[int, list[int], int]], k: int, min_prob: float,
                      spec_factor: float) -> tuple[float, list[int]]:
    """(expected accepted tokens, guesses) of the best match length among `found`."""
    best: tuple[float, list[int]] = (0.0, [])
    lengths = sorted({n for n, _, _ in found}, reverse=True)[:MAX_CANDIDATES]
    for length in lengths:
        places = [(tokens, start) for n, tokens, start in found if n >= length]
        limit = min(k, max(1, math.floor(spec_factor * length)))
        score, path = _walk(places, limit, min_prob)
        if score > best[0]:
            best = (score, path)
    return best


def _walk(places: list[tuple[list[int], int]], limit: int,
          min_prob: float) -> tuple[float, list[int]]:
    """Follow the token most of `places` continue with while its cumulative probability
    (continuing / all at that depth) stays >= min_prob."""
    path: list[int] = []
    prob, score, depth = 1.0, 0.0, 0
    while len(path) < limit and places:
        counts = collections.Counter(tokens[start + depth] for tokens, start in places
                                     if start + depth < len(tokens))
        if not counts:
            break
        token, count = counts.most_common(1)[0]
        p = prob * count / len(places)
        if p < min_prob:
            break
        prob = p
        score += p
        path.append(token)
        places = [(tokens, start) for tokens, start in places
                  if start + depth < len(tokens) and tokens[start + depth] == token]
        depth += 1
    return score, path


class SuffixCache:
    """The engine-wide cache: the outputs of the last `max_requests` requests."""

    def __init__(self, max_requests: int) -> None:
        self.max_requests = max_requests
        self.index = SuffixIndex()
        self._order: collections.deque = collections.deque()
        self._num_added = 0

    def add(self, request_id: str, output: list[int]) -> None:
        if self.max_requests <= 0 or len(output) < 2:
            return
        self._num_added += 1
        key = (request_id, self._num_added)  # (an id may come back: a new entry)
        self.index.extend(key, list(output))
        self._order.append(key)
        while len(self._order) > self.max_requests:
            self.index.remove(self._order.popleft())


class SuffixProposer:
    """One sequence's proposals: its own tokens and the engine-wide cache."""

    def __init__(self, cache: SuffixCache, max_depth: int, min_prob: float,
                 spec_factor: float) -> None:
        self.cache = cache
        self.own = SuffixIndex()
        self.max_depth = max_depth
        self.min_prob = min_prob
        self.spec_factor = spec_factor

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to `k` guesses after `tokens` (the sequence's prompt and output so far)."""
        if k <= 0 or not tokens:
            return []
        self.own.extend(0, tokens)
        context = tokens[-self.max_depth:]
        found = self.own.occurrences(context, self.max_depth)  # (not the last token itself)
        found += self.cache.index.occurrences(context, self.max_depth)
        return best_continuation(found, k, self.min_prob, self.spec_factor)[1]
