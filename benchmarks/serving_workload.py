"""The workload of benchmarks/bench_serving.py: prompts of random token ids (or words) with
exact lengths, uniform (one length, optional jitter) or mixed (short and long prompts), and
Poisson arrival times. The same spec and seed always give the same requests."""
from __future__ import annotations

import dataclasses
import math
import random

_WORDS = ("time person year way day thing man world life hand part child eye woman place "
          "work week case point number group problem fact river mountain engine token "
          "cache block prefill decode server cluster model layer batch stream").split()


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    num_requests: int
    input_len: int
    output_len: int
    len_jitter: float = 0.0  # uniform +- fraction around both lengths
    prompt_kind: str = "tokens"  # "tokens": random token ids; "words": random words (text)
    vocab_size: int = 1024
    min_token_id: int = 16  # keep clear of special tokens at the bottom of small vocabularies
    seed: int = 0
    # "uniform": input_len (jittered); "mixed": short_frac of the prompts short_len tokens,
    # the others uniform in long_len (both ends included)
    workload: str = "uniform"
    short_frac: float = 0.7
    short_len: int = 128
    long_len: tuple[int, int] = (1024, 2048)


@dataclasses.dataclass
class BenchRequest:
    index: int
    prompt: list[int] | str
    input_len: int  # intended (exact for token prompts)
    output_len: int


def _jittered(n: int, jitter: float, rng: random.Random) -> int:
    if jitter <= 0:
        return n
    return max(1, round(n * rng.uniform(1 - jitter, 1 + jitter)))


def build_requests(spec: WorkloadSpec, num: int | None = None, seed_offset: int = 0) -> list[BenchRequest]:
    """The same spec and seed always give the same prompts and lengths."""
    rng = random.Random(spec.seed + seed_offset)
    out = []
    for i in range(spec.num_requests if num is None else num):
        if spec.workload == "mixed":
            short = rng.random() < spec.short_frac
            n_in = spec.short_len if short else rng.randint(*spec.long_len)
        else:
            n_in = _jittered(spec.input_len, spec.len_jitter, rng)
        n_out = _jittered(spec.output_len, spec.len_jitter, rng)
        if spec.prompt_kind == "tokens":
            prompt: list[int] | str = [rng.randrange(spec.min_token_id, spec.vocab_size)
                                       for _ in range(n_in)]
        else:
            prompt = " ".join(rng.choice(_WORDS) for _ in range(n_in))
        out.append(BenchRequest(i, prompt, n_in, n_out))
    return out


def arrival_offsets(num: int, request_rate: float, seed: int = 0) -> list[float]:
    """Send times (s from the start) of a Poisson process; rate inf: all at 0."""
    if math.isinf(request_rate):
        return [0.0] * num
    rng = random.Random(seed + 7919)
    t, out = 0.0, []
    for _ in range(num):
        out.append(t)
        t += rng.expovariate(request_rate)
    return out
