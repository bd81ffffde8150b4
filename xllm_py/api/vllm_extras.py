"""vLLM's request extras on /v1/completions and /v1/chat/completions, and OpenAI's
Predicted Outputs:

  allowed_token_ids       only these tokens may be sampled (SamplingParams, the sampler)
  bad_words               words never generated: each is tokenized here, as it stands and
                          after a space (the two ways it starts inside a text), and the
                          sampler bans a sequence's last token where the output ends with
                          the rest of it (SamplingParams.bad_words_token_ids)
  truncate_prompt_tokens  keep the prompt's last k tokens (-1: the model's context length)
  chat_template, chat_template_kwargs (chat only: serving_chat.py) a template of the
                          request's own (rendered sandboxed, as the model's) and the
                          variables it is given besides the messages
  prediction              OpenAI's Predicted Outputs, {"type": "content", "content": text
                          or text parts}: text the output is expected to repeat (an edit
                          of a given file), tokenized here; the engine takes guesses from
                          it (SamplingParams.prediction_token_ids), the output unchanged

The sampling ones travel in SamplingParams, so a PD pair and a migration carry them like
the other sampling parameters.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, PrivateAttr

from xllm_py.api.backend import TokenizerLike
from xllm_py.api.validation import check

MAX_ALLOWED_TOKEN_IDS = 1 << 18  # the largest vocabularies have ~256k tokens
MAX_BAD_WORDS = 128
MAX_BAD_WORD_CHARS = 256
MAX_PREDICTION_CHARS = 1 << 20


class VLLMExtraFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    prediction: Any = None
    _bad_words_token_ids: list[list[int]] = PrivateAttr(default_factory=list)
    _prediction_token_ids: list[int] = PrivateAttr(default_factory=list)

    def check_extras(self) -> None:
        ids = self.allowed_token_ids or []
        check(len(ids) <= MAX_ALLOWED_TOKEN_IDS, "allowed_token_ids",
              f"allowed_token_ids has at most {MAX_ALLOWED_TOKEN_IDS} ids")
        check(all(t >= 0 for t in ids), "allowed_token_ids",
              "allowed_token_ids must be non-negative token ids")
        words = self.bad_words or []
        check(len(words) <= MAX_BAD_WORDS, "bad_words",
              f"bad_words has at most {MAX_BAD_WORDS} words")
        check(all(0 < len(w) <= MAX_BAD_WORD_CHARS for w in words), "bad_words",
              f"a bad word has 1 to {MAX_BAD_WORD_CHARS} characters")
        k = self.truncate_prompt_tokens
        check(k is None or k == -1 or k >= 1, "truncate_prompt_tokens",
              f"truncate_prompt_tokens must be -1 or at least 1, got {k}")
        prediction_text(self.prediction)

    def apply_tokenizer(self, tokenizer: TokenizerLike) -> None:
        """Tokenize bad_words; check allowed_token_ids against the vocabulary (400)."""
        vocab = getattr(tokenizer, "vocab_size", None)
        if vocab is not None and self.allowed_token_ids:
            bad = [t for t in self.allowed_token_ids if t >= vocab]
            check(not bad, "allowed_token_ids", f"allowed_token_ids has token id "
                  f"{bad[0] if bad else 0}, outside the vocabulary of {vocab} tokens")
        seqs: list[list[int]] = []
        for word in self.bad_words or []:
            for text in (word, " " + word.lstrip()):
                ids = list(tokenizer.encode(text, add_special_tokens=False))
                if ids and ids not in seqs:
                    seqs.append(ids)
        self._bad_words_token_ids = seqs
        text = prediction_text(self.prediction)
        self._prediction_token_ids = (
            list(tokenizer.encode(text, add_special_tokens=False)) if text else [])

    def truncated(self, token_ids: list[int], max_model_len: int) -> list[int]:
        k = self.truncate_prompt_tokens
        if k is None:
            return token_ids
        k = max_model_len if k == -1 else k
        return token_ids[-k:] if len(token_ids) > k else token_ids

    def extra_sampling_fields(self) -> dict[str, Any]:
        """Those of SamplingParams' fields the client set (after apply_tokenizer)."""
        fields = {"allowed_token_ids": list(self.allowed_token_ids or []),
                  "bad_words_token_ids": self._bad_words_token_ids,
                  "prediction_token_ids": self._prediction_token_ids}
        return {name: value for name, value in fields.items() if value}


def prediction_text(prediction: Any) -> str | None:
    """The text of a `prediction` (None: none); 400 unless it is OpenAI's shape."""
    if prediction is None:
        return None
    check(isinstance(prediction, dict) and prediction.get("type") == "content"
          and set(prediction) <= {"type", "content"}, "prediction",
          'prediction must be {"type": "content", "content": ...}')
    content = prediction.get("content")
    if isinstance(content, list):
        check(all(isinstance(part, dict) and part.get("type") == "text"
                  and isinstance(part.get("text"), str) for part in content), "prediction",
              'prediction content parts must be {"type": "text", "text": ...}')
        content = "".join(part["text"] for part in content)
    check(isinstance(content, str), "prediction",
          "prediction content must be a string or a list of text parts")
    check(len(content) <= MAX_PREDICTION_CHARS, "prediction",
          f"prediction content has at most {MAX_PREDICTION_CHARS} characters")
    return content
