"""Beam search on /v1/completions (vLLM's `use_beam_search`, `n` beams, `length_penalty`),
run at the HTTP layer over any backend, as vLLM runs it.

Each step asks the backend for the next token's top-K logprobs of every running beam (one
greedy request of one token per beam; the engine's prefix cache holds what the beams
share), so a PD pair and a MIX engine serve it alike. Beams are kept as Hugging Face
transformers' `generate(num_beams=W, do_sample=False)` keeps them (its default
`early_stopping=False`): the top K = max(2, 1 + #EOS) * W continuations over all beams;
those among the top W that end (an EOS token, or max_tokens reached) are finished with
the score logprob / generated_length ** length_penalty and the best W finished kept; the
best W others run on; the search stops when the best running beam, scored at its current
length, cannot beat the worst of W finished ones. The result: the best `n` finished beams,
best first, so the best beam is transformers' own.
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import AsyncIterator, Awaitable, Callable, Sequence

from xllm_py.api.backend import GenerateBackend, GenerateRequest, TokenizerLike
from xllm_py.api.errors import BackendError
from xllm_py.api.generations import aclose_stream
from xllm_py.outputs import CompletionDelta, RequestOutput
from xllm_py.sampling_params import SamplingParams

# A step: (beam's tokens so far, k) -> the next token's top-k (token id, logprob), best first.
Step = Callable[[list[int], int], Awaitable[list[tuple[int, float]]]]


@dataclasses.dataclass
class Beam:
    tokens: list[int]
    logprob: float  # cumulative
    score: float = 0.0  # finished: logprob / generated_length ** length_penalty
    ended_by_eos: bool = False


def candidates_per_step(width: int, num_eos: int) -> int:
    return max(2, 1 + num_eos) * width


async def beam_search(step: Step, width: int, max_tokens: int, eos_token_ids: Sequence[int],
                      length_penalty: float = 1.0) -> list[Beam]:
    """The finished beams, best first (at most `width`). `eos_token_ids` empty: no beam
    ends before max_tokens (ignore_eos)."""
    eos = set(eos_token_ids)
    k = candidates_per_step(width, len(eos))
    running = [Beam([], 0.0)]
    finished: list[Beam] = []
    for length in range(1, max_tokens + 1):
        tops = await asyncio.gather(*(step(b.tokens, k) for b in running))
        found = [(b.logprob + lp, i, token) for i, (b, top) in enumerate(zip(running, tops))
                 for token, lp in top[:k]]
        found.sort(key=lambda c: -c[0])  # (stable: ties keep the beam and rank order)
        found = found[:k]
        last = length == max_tokens
        ends = [last or token in eos for _, _, token in found]
        new = [Beam(running[i].tokens + [token], total, total / length ** length_penalty,
                    token in eos)
               for j, (total, i, token) in enumerate(found[:width]) if ends[j]]
        finished = sorted(finished + new, key=lambda b: -b.score)[:width]
        running = [Beam(running[i].tokens + [token], total)
                   for (total, i, token), end in zip(found, ends) if not end][:width]
        if last or not running:
            break
        if (len(finished) == width
                and running[0].logprob / length ** length_penalty <= finished[-1].score):
            break  # no running beam can beat the worst finished one
    return finished


def backend_step(backend: GenerateBackend, request_id: str, prompt: list[int],
                 x_request_id: str | None) -> Step:
    """A step over `backend`: a one-token greedy request per beam, its top-k logprobs."""
    counter = iter(range(1 << 62))

    async def step(tokens: list[int], k: int) -> list[tuple[int, float]]:
        req = GenerateRequest(
            request_id=f"{request_id}-beam{next(counter)}", prompt_token_ids=prompt + tokens,
            sampling=SamplingParams(max_tokens=1, temperature=0.0, logprobs=k, ignore_eos=True),
            x_request_id=x_request_id)
        stream = backend.generate(req)
        try:
            async for out in stream:
                if out.failed:
                    raise BackendError(out.error_message, out.error_code)
                for delta in out.outputs:
                    if delta.logprobs:
                        return list(delta.logprobs[0].top)
            raise BackendError("the backend sent no logprobs for a beam search step")
        finally:
            await aclose_stream(stream)

    return step


async def beam_stream(backend: GenerateBackend, tokenizer: TokenizerLike, req: GenerateRequest,
                      length_penalty: float) -> AsyncIterator[RequestOutput]:
    """One prompt's beam search as a backend stream: a single finished RequestOutput whose
    choices are the best `n` beams (finish_reason stop: ended by EOS; length: by max_tokens)."""
    s = req.sampling
    eos = [] if s.ignore_eos else list(s.eos_token_ids or tokenizer.eos_token_ids)
    beams = await beam_search(
        backend_step(backend, req.request_id, req.prompt_token_ids, req.x_request_id),
        s.n, s.max_tokens or 1, eos, length_penalty)
    yield RequestOutput(req.request_id, finished=True, outputs=[
        CompletionDelta(index=j, token_ids=b.tokens, finish_reason="stop" if b.ended_by_eos
                        else "length",
                        text=tokenizer.decode(b.tokens, skip_special_tokens=s.skip_special_tokens))
        for j, b in enumerate(beams[:s.n])])
