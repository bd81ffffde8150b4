"""Helpers shared by the benchmarks: percentiles, a small OpenAI-endpoint load client,
an engine-process launcher, torch thread settings and the environment a run reports.

The load client talks to any OpenAI-compatible ``/v1/completions`` endpoint (the engine or
the service) with ``httpx`` directly: it is cheaper on the CPU than the ``openai`` client,
which matters when client and server share a small machine. Streaming requests record the
time of every chunk (TTFT, inter-token gaps); non-streaming ones only the end-to-end time.

    results = asyncio.run(run_load(base_url, model, prompts, max_tokens=64,
                                   concurrency=32, stream=False))
    summary = summarize_load(results, wall_s)
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.metadata
import json
import logging
import math
import os
import pathlib
import platform
import random
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TextIO

import httpx

if TYPE_CHECKING:
    from xllm_py.utils.procs import ChildProcess

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------- statistics
def percentile(values: Sequence[float], q: float) -> float:
    """q-th percentile (0..100) with linear interpolation between closest ranks (numpy's
    default). NaN for an empty sequence."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q must be in [0, 100], got {q}")
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values: Sequence[float], qs: Sequence[float] = (50, 90, 99)) -> dict[str, float]:
    """mean, min, max and the given percentiles (keys ``p50`` ...) of ``values``."""
    if not values:
        return {"n": 0}
    out: dict[str, float] = {"n": len(values), "mean": sum(values) / len(values),
                             "min": min(values), "max": max(values)}
    for q in qs:
        out[f"p{q:g}"] = percentile(values, q)
    return out


def median(values: Sequence[float]) -> float:
    return percentile(values, 50)


# ---------------------------------------------------------------------------- environment
def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def time_call_ms(fn: Callable[[], object], repeat: int,
                 reduce: Callable[[list[float]], float] = min) -> float:
    """`fn` once to warm up, then `repeat` timed calls: `reduce` of their times (ms)."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000.0)
    return reduce(times)


def run_environment() -> dict[str, Any]:
    """What a benchmark runs with: python, torch, transformers (None: not installed), the
    CPU model, the cores this process may use and the machine's, and the 1-minute load
    average now (other processes on the cores: engine-vs-HF ratios depend on it)."""
    from xllm_py.utils.machine import cpu_model

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        usable = os.cpu_count() or 0
    try:
        load = round(os.getloadavg()[0], 2)
    except OSError:
        load = None
    return {"python": platform.python_version(), "torch": _package_version("torch"),
            "transformers": _package_version("transformers"), "cpu_model": cpu_model(),
            "num_cores": usable, "num_cores_machine": os.cpu_count(), "load_avg_1m": load}


def report_environment(result: dict[str, Any] | None = None,
                       file: TextIO | None = None) -> dict[str, Any]:
    """``run_environment()``, printed as one ``ran with:`` line to ``file`` (default stdout;
    stderr keeps a JSON stdout clean) and stored as ``result["environment"]`` when given."""
    env = run_environment()
    if result is not None:
        result["environment"] = env
    print(f"ran with: python {env['python']}, torch {env['torch']}, transformers "
          f"{env['transformers']}, {env['cpu_model']}, {env['num_cores']} cores "
          f"(machine {env['num_cores_machine']}), load average {env['load_avg_1m']} (1 min)",
          file=file or sys.stdout, flush=True)
    return env


# ---------------------------------------------------------------------------- prompts
def random_token_prompts(num_prompts: int, num_tokens: int, vocab_size: int, seed: int = 0,
                         low: int = 3) -> list[list[int]]:
    """Prompts of exactly ``num_tokens`` ids drawn from ``[low, vocab_size)`` (``low``
    skips special tokens at the start of the vocabulary). Same seed, same prompts."""
    rng = random.Random(seed)
    return [[rng.randrange(low, vocab_size) for _ in range(num_tokens)]
            for _ in range(num_prompts)]


# ---------------------------------------------------------------------------- load client
@dataclasses.dataclass
class RequestResult:
    ok: bool
    latency_s: float = 0.0  # send -> last byte
    ttft_s: float | None = None  # streaming only: send -> first token chunk
    chunk_times_s: list[float] = dataclasses.field(default_factory=list)  # streaming only
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    token_ids: list[int] | None = None  # with return_token_ids
    error: str | None = None

    @property
    def itl_s(self) -> list[float]:
        """Gaps between consecutive token chunks (streaming only)."""
        t = self.chunk_times_s
        return [b - a for a, b in zip(t, t[1:])]


def completion_body(model: str, prompt: str | list[int], max_tokens: int, *,
                    stream: bool = False, ignore_eos: bool = True,
                    return_token_ids: bool = False, **extra: Any) -> dict[str, Any]:
    """A greedy ``/v1/completions`` body; ``extra`` adds or overrides fields."""
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                            "temperature": 0.0, "stream": stream, "ignore_eos": ignore_eos}
    if return_token_ids:
        body["return_token_ids"] = True
    if stream:
        body["stream_options"] = {"include_usage": True}
    body.update(extra)
    return body


async def send_completion(client: httpx.AsyncClient, base_url: str,
                          body: dict[str, Any]) -> RequestResult:
    """POST one completion; never raises for HTTP or protocol errors (ok=False instead)."""
    url = base_url.rstrip("/") + "/v1/completions"
    t0 = time.perf_counter()
    try:
        if not body.get("stream"):
            r = await client.post(url, json=body)
            latency = time.perf_counter() - t0
            if r.status_code != 200:
                return RequestResult(False, latency, error=f"HTTP {r.status_code}: {r.text[:200]}")
            data = r.json()
            usage = data.get("usage") or {}
            choice = data["choices"][0]
            return RequestResult(True, latency,
                                 num_prompt_tokens=usage.get("prompt_tokens", 0),
                                 num_completion_tokens=usage.get("completion_tokens", 0),
                                 token_ids=choice.get("token_ids"))
        res = RequestResult(True)
        token_ids: list[int] = []
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                return RequestResult(False, time.perf_counter() - t0,
                                     error=f"HTTP {r.status_code}: {text[:200]}")
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                event = json.loads(payload)
                now = time.perf_counter() - t0
                if event.get("usage"):
                    res.num_prompt_tokens = event["usage"].get("prompt_tokens", 0)
                    res.num_completion_tokens = event["usage"].get("completion_tokens", 0)
                for choice in event.get("choices") or []:
                    if choice.get("text") or choice.get("token_ids"):
                        if res.ttft_s is None:
                            res.ttft_s = now
                        res.chunk_times_s.append(now)
                        token_ids.extend(choice.get("token_ids") or [])
        res.latency_s = time.perf_counter() - t0
        res.token_ids = token_ids or None
        return res
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        return RequestResult(False, time.perf_counter() - t0, error=repr(exc))


async def run_load(base_url: str, model: str, prompts: Sequence[str | list[int]],
                   max_tokens: int, concurrency: int, *, stream: bool = False,
                   timeout_s: float = 600.0, keepalive: bool = True,
                   per_prompt: Sequence[dict[str, Any]] | None = None,
                   **body_extra: Any) -> tuple[list[RequestResult], float]:
    """Send every prompt with at most ``concurrency`` requests in flight (a closed loop:
    a worker sends its next prompt when the previous one ends). Returns the results in
    prompt order and the wall time from the first send to the last answer.
    ``per_prompt``: body fields of each prompt's request (after ``body_extra``).

    ``keepalive=False``: a new connection per request (``Connection: close``), for
    servers that drop kept-alive connections under the client (llama.cpp's)."""
    if concurrency <= 0:
        raise ValueError(f"concurrency must be positive, got {concurrency}")
    results: list[RequestResult | None] = [None] * len(prompts)
    next_idx = 0
    limits = httpx.Limits(max_connections=concurrency,
                          max_keepalive_connections=concurrency if keepalive else 0)
    headers = None if keepalive else {"Connection": "close"}
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits, trust_env=False,
                                 headers=headers) as client:

        async def worker() -> None:
            nonlocal next_idx
            while next_idx < len(prompts):
                i = next_idx
                next_idx += 1
                body = completion_body(model, prompts[i], max_tokens, stream=stream, **body_extra,
                                       **(per_prompt[i] if per_prompt else {}))
                results[i] = await send_completion(client, base_url, body)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(prompts)))))
        wall = time.perf_counter() - t0
    return [r for r in results if r is not None], wall


def summarize_load(results: Sequence[RequestResult], wall_s: float) -> dict[str, Any]:
    """Throughput (generated tokens / wall time) and latency percentiles of one load run."""
    ok = [r for r in results if r.ok]
    gen = sum(r.num_completion_tokens for r in ok)
    out: dict[str, Any] = {
        "num_requests": len(results), "num_failed": len(results) - len(ok),
        "wall_s": wall_s, "generated_tokens": gen,
        "output_tokens_per_s": gen / wall_s if wall_s > 0 else math.nan,
        "latency_s": summarize([r.latency_s for r in ok]),
    }
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    if ttfts:
        out["ttft_s"] = summarize(ttfts)
        out["itl_s"] = summarize([g for r in ok for g in r.itl_s])
    errors = [r.error for r in results if not r.ok]
    if errors:
        out["first_error"] = errors[0]
    return out


async def get_model_id(base_url: str) -> str:
    """The first model id that ``/v1/models`` lists."""
    async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
        r = await client.get(base_url.rstrip("/") + "/v1/models")
        r.raise_for_status()
        return r.json()["data"][0]["id"]


# ---------------------------------------------------------------------------- processes
def thread_env(num_threads: int) -> dict[str, str]:
    """Environment that makes a child's torch/OpenMP/MKL use ``num_threads`` threads."""
    n = str(num_threads)
    return {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "OPENBLAS_NUM_THREADS": n}


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, all threads (Linux /proc); NaN elsewhere.

    On a shared machine, CPU time is a steadier cost measure than wall time: it does not
    count the time the process waited for a core."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return math.nan
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def engine_process(model: str, *, role: str = "MIX", num_threads: int | None = None,
                   extra_args: Sequence[str] = (), log_dir: str | os.PathLike | None = None,
                   ready_timeout_s: float = 300.0,
                   settings: dict | None = None) -> Iterator["ChildProcess"]:
    """Start ``python -m xllm_py.engine`` on a free loopback port, wait for /health, yield
    the process (``.http_url``, ``.pid``); SIGTERM (then SIGKILL) on exit. ``num_threads``
    sets its torch threads through the OpenMP/MKL environment variables; ``settings``:
    its settings file (``python -m xllm_py.engine --help``, at the end)."""
    import tempfile

    from xllm_py.utils.config_file import write_settings
    from xllm_py.utils.procs import engine_args, free_port, spawn

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = thread_env(num_threads) if num_threads else None
    tmp = None
    if log_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="xllm-bench-")
        log_dir = tmp.name
    if settings:
        extra_args = [*write_settings(pathlib.Path(log_dir) / f"engine-{port}.yaml", settings),
                      *extra_args]
    proc = spawn(f"engine-{role.lower()}-{port}", "xllm_py.engine",
                 engine_args(role, port, model=model, extra=list(extra_args)),
                 pathlib.Path(log_dir), http_url=url, env=env)
    try:
        proc.wait_ready(ready_timeout_s)
        yield proc
    finally:
        proc.terminate()
        if tmp is not None:
            tmp.cleanup()
