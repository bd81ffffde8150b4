"""Logprobs in the two OpenAI formats, from the backend's `TokenLogprob` entries.

Completions (`completion_logprobs`): parallel lists `tokens`, `token_logprobs`,
`top_logprobs` (a dict per token) and `text_offset`; an entry of None (an echoed prompt
token without a logprob) renders as null. Chat (`chat_logprobs`): a list of
`{token, logprob, bytes, top_logprobs: [...]}`. vLLM's `prompt_logprobs`
(`vllm_prompt_logprobs`): per prompt token null (the first) or `{"<id>": {logprob, rank,
decoded_token}}` with the token itself and its top-k. Token strings come from decoding the
single id (`TokenText`, cached per request). JSON has no -inf: values are clamped.
"""
from __future__ import annotations

from typing import Any, Callable

from xllm_py.api.backend import TokenizerLike
from xllm_py.outputs import TokenLogprob

MIN_LOGPROB = -9999.0  # JSON has no -inf


class TokenText:
    """Token id -> string, by decoding the single id (cached per request)."""

    def __init__(self, tokenizer: TokenizerLike) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        s = self._cache.get(token_id)
        if s is None:
            s = self._tokenizer.decode([token_id])
            self._cache[token_id] = s
        return s


def clamp(value: float) -> float:
    return max(float(value), MIN_LOGPROB)


def entries_for(token_ids: list[int], logprobs: list[TokenLogprob] | None) -> list[TokenLogprob]:
    """Logprob entries aligned with token ids (backends that omit them get zeros)."""
    logprobs = logprobs or []
    if len(logprobs) == len(token_ids):
        return logprobs
    by_pos = list(logprobs) + [
        TokenLogprob(token_id=t, logprob=0.0) for t in token_ids[len(logprobs):]
    ]
    return by_pos[: len(token_ids)]


def completion_logprobs(
    entries: list[TokenLogprob | None],
    num_top: int,
    token_text: Callable[[int], str],
    token_ids: list[int],
    text_offset: int,
) -> tuple[dict[str, Any], int]:
    """Completions format; `entries[i] is None` for echoed prompt tokens. Returns (dict, next offset)."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for token_id, entry in zip(token_ids, entries):
        s = token_text(token_id)
        tokens.append(s)
        offsets.append(text_offset)
        text_offset += len(s)
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(clamp(entry.logprob))
        top: dict[str, float] = {}
        for tid, value in entry.top[:num_top]:
            top.setdefault(token_text(tid), clamp(value))
        top.setdefault(s, clamp(entry.logprob))  # the sampled token is always included
        top_logprobs.append(top)
    return (
        {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
         "text_offset": offsets},
        text_offset,
    )


def chat_logprobs(
    entries: list[TokenLogprob], num_top: int, token_text: Callable[[int], str]
) -> list[dict[str, Any]]:
    content = []
    for entry in entries:
        s = token_text(entry.token_id)
        content.append({
            "token": s,
            "logprob": clamp(entry.logprob),
            "bytes": list(s.encode("utf-8")),
            "top_logprobs": [
                {"token": (t := token_text(tid)), "logprob": clamp(value),
                 "bytes": list(t.encode("utf-8"))}
                for tid, value in entry.top[:num_top]
            ],
        })
    return content


def vllm_prompt_logprobs(
    entries: list[TokenLogprob | None], num_top: int, token_text: Callable[[int], str]
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's format of prompt logprobs. A token's rank is its place among the top-k
    (1 = most likely); a prompt token outside the top-k has rank null (the engine keeps
    only the top-k)."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        top = entry.top[:num_top]
        ranks = {tid: i + 1 for i, (tid, _) in enumerate(entry.top)}
        position: dict[str, dict[str, Any]] = {
            str(entry.token_id): {"logprob": clamp(entry.logprob),
                                  "rank": ranks.get(entry.token_id),
                                  "decoded_token": token_text(entry.token_id)},
        }
        for i, (tid, value) in enumerate(top):
            position.setdefault(str(tid), {"logprob": clamp(value), "rank": i + 1,
                                           "decoded_token": token_text(tid)})
        out.append(position)
    return out
