"""The two OpenAI logprobs formats, on their own (no server)."""
from __future__ import annotations

from xllm_py.api.logprobs import (
    MIN_LOGPROB,
    chat_logprobs,
    completion_logprobs,
    entries_for,
)
from xllm_py.outputs import TokenLogprob

_TEXT = {1: "<s>", 97: "a", 98: "b", 99: "ć"}.__getitem__


def test_completion_format_with_echoed_prompt_and_offsets():
    entries = [None, TokenLogprob(97, -0.5, [(98, -0.25), (97, -0.5)]),
               TokenLogprob(99, float("-inf"), [])]
    lp, offset = completion_logprobs(entries, 1, _TEXT, [1, 97, 99], text_offset=10)
    assert lp == {
        "tokens": ["<s>", "a", "ć"],
        "token_logprobs": [None, -0.5, MIN_LOGPROB],  # -inf is not JSON
        "top_logprobs": [None, {"b": -0.25, "a": -0.5}, {"ć": MIN_LOGPROB}],
        "text_offset": [10, 13, 14],
    }
    assert offset == 15


def test_chat_format_has_bytes_and_top_k_only():
    content = chat_logprobs([TokenLogprob(99, -1.0, [(97, -0.1), (98, -0.2)])], 1, _TEXT)
    assert content == [{"token": "ć", "logprob": -1.0, "bytes": [0xC4, 0x87],
                        "top_logprobs": [{"token": "a", "logprob": -0.1, "bytes": [97]}]}]


def test_entries_align_with_token_ids():
    given = [TokenLogprob(97, -0.5)]
    assert entries_for([97], given) is given
    padded = entries_for([97, 98], given)
    assert [(e.token_id, e.logprob) for e in padded] == [(97, -0.5), (98, 0.0)]
    assert entries_for([97], given + [TokenLogprob(98, -1.0)]) == given
