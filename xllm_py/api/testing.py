"""Test doubles for the HTTP layer: a character-level tokenizer and a scripted backend.

`ScriptedBackend` generates, for choice j, the token `ord('a') + (k + j) % 26` at step k,
one RequestOutput per step covering all n choices; it honours max_tokens (0: one finished
output without tokens), stop strings, stop_token_ids, logprobs and prompt_logprobs (the
first output: `prompt_logprob_of(i)` for prompt token i, its top-k: the token itself then
"A", "B", ...), and records requests and cancellations for assertions. It is safe to
inspect from another thread (the server usually runs in its own loop).
"""
from __future__ import annotations

import asyncio
import threading
from typing import AsyncIterator, Sequence

from prometheus_client import CollectorRegistry, Gauge

from xllm_py.api.backend import GenerateRequest
from xllm_py.api.errors import BackendBusyError
from xllm_py.outputs import CompletionDelta, RequestOutput, TokenLogprob

BOS_ID = 1
EOS_ID = 2


class FakeTokenizer:
    """Token id = code point; id 1 is BOS ("<s>"), id 2 EOS ("</s>")."""

    eos_token_ids: Sequence[int] = (EOS_ID,)
    _special = {BOS_ID: "<s>", EOS_ID: "</s>"}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([BOS_ID] if add_special_tokens else []) + [ord(c) for c in text]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        parts = []
        for t in token_ids:
            if t in self._special:
                if not skip_special_tokens:
                    parts.append(self._special[t])
            else:
                parts.append(chr(t))
        return "".join(parts)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        text = "".join(f"<|tool|>{t['function']['name']}\n" for t in tools or [])
        text += "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages)
        return text + ("<|assistant|>" if add_generation_prompt else "")


class ScriptedBackend:
    def __init__(
        self, model_name: str = "fake-model", max_model_len: int = 256, token_delay: float = 0.0
    ) -> None:
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.token_delay = token_delay
        self.ready: tuple[bool, str] = (True, "")
        self.busy = False  # raise BackendBusyError on the first iteration
        self.fail_after: int | None = None  # emit an error output after this many steps
        self.fail_code = 500
        self.num_cached_tokens = 0
        self.predicted = (0, 0)  # a prediction's guessed tokens kept, not kept (usage)
        self.requests: list[GenerateRequest] = []
        self.cancelled: list[str] = []
        self.cancelled_event = threading.Event()
        self._lock = threading.Lock()
        self._tokenizer = FakeTokenizer()
        self.metrics_registry = CollectorRegistry(auto_describe=True)
        Gauge("fake_backend_waiting", "Requests waiting (always 0).",
              registry=self.metrics_registry).set(0)

    def reset(self) -> None:
        with self._lock:
            self.ready = (True, "")
            self.busy = False
            self.fail_after = None
            self.fail_code = 500
            self.token_delay = 0.0
            self.num_cached_tokens = 0
            self.predicted = (0, 0)
            self.requests.clear()
            self.cancelled.clear()
            self.cancelled_event.clear()

    def tokenizer(self) -> FakeTokenizer:
        return self._tokenizer

    def check_ready(self) -> tuple[bool, str]:
        return self.ready

    @staticmethod
    def token_for(step: int, choice: int) -> int:
        return ord("a") + (step + choice) % 26

    @staticmethod
    def prompt_logprob_of(i: int) -> float:
        return -0.25 * i

    @classmethod
    def _prompt_logprobs(cls, req: GenerateRequest) -> list[TokenLogprob | None] | None:
        if req.sampling.prompt_logprobs is None:
            return None
        entries: list[TokenLogprob | None] = [None]
        for i, token in enumerate(req.prompt_token_ids[1:], start=1):
            lp = cls.prompt_logprob_of(i)
            top = [(token, lp)] + [(ord("A") + r, lp - 1.0 - r)
                                   for r in range(req.sampling.prompt_logprobs)]
            entries.append(TokenLogprob(token, lp, top[:req.sampling.prompt_logprobs]))
        return entries

    async def generate(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        with self._lock:
            self.requests.append(req)
        if self.busy:
            raise BackendBusyError("fake backend is full")
        texts = [""] * req.sampling.n
        done = [False] * req.sampling.n
        finished = False
        prompt_logprobs = self._prompt_logprobs(req)
        if req.sampling.max_tokens == 0:
            finished = True
            yield RequestOutput(
                request_id=req.request_id, finished=True,
                outputs=[CompletionDelta(index=j, finish_reason="length")
                         for j in range(req.sampling.n)],
                num_prompt_tokens=len(req.prompt_token_ids),
                prompt_token_ids=req.prompt_token_ids, prompt_logprobs=prompt_logprobs)
            return
        try:
            for step in range(req.sampling.max_tokens):
                if self.token_delay:
                    await asyncio.sleep(self.token_delay)
                else:
                    await asyncio.sleep(0)
                if self.fail_after is not None and step >= self.fail_after:
                    finished = True
                    yield RequestOutput(
                        request_id=req.request_id, finished=True, error_code=self.fail_code,
                        error_message="fake backend failure",
                    )
                    return
                deltas = []
                for j in range(req.sampling.n):
                    if done[j]:
                        continue
                    token = self.token_for(step, j)
                    text = chr(token)
                    delta = CompletionDelta(index=j, text=text, token_ids=[token])
                    if req.sampling.logprobs is not None:
                        top = [(self.token_for(step, j + r), -0.5 * (r + 1))
                               for r in range(req.sampling.logprobs)]
                        delta.logprobs = [TokenLogprob(token, -0.5, top)]
                    texts[j] += text
                    for s in req.sampling.stop:
                        if texts[j].endswith(s):
                            if not req.sampling.include_stop_str_in_output:
                                delta.text = text[: len(text) - len(s)] if len(s) <= len(text) else ""
                            delta.finish_reason, delta.stop_reason = "stop", s
                    if token in req.sampling.stop_token_ids:
                        delta.finish_reason, delta.stop_reason = "stop", token
                    if delta.finish_reason is None and step == req.sampling.max_tokens - 1:
                        delta.finish_reason = "length"
                    done[j] = delta.finish_reason is not None
                    deltas.append(delta)
                finished = all(done)
                yield RequestOutput(
                    request_id=req.request_id, outputs=deltas, finished=finished,
                    num_prompt_tokens=len(req.prompt_token_ids), num_generated_tokens=step + 1,
                    num_cached_tokens=self.num_cached_tokens,
                    num_accepted_prediction_tokens=self.predicted[0],
                    num_rejected_prediction_tokens=self.predicted[1],
                    prompt_token_ids=req.prompt_token_ids if step == 0 else None,
                    prompt_logprobs=prompt_logprobs if step == 0 else None,
                )
                if finished:
                    return
        finally:
            if not finished:
                with self._lock:
                    self.cancelled.append(req.request_id)
                self.cancelled_event.set()
