"""The client of benchmarks/bench_serving.py: one streaming /v1/completions request
(`send_request`: TTFT, ITL, output tokens from the SSE chunks), a load of them on an
arrival schedule with at most a concurrency in flight (`run_load`), a progress bar."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time
from typing import Any

import httpx

from benchmarks.serving_workload import BenchRequest, arrival_offsets

@dataclasses.dataclass
class RequestResult:
    index: int
    ok: bool = False
    error: str = ""
    input_len: int = 0
    output_len: int = 0
    start: float = 0.0  # perf_counter at send
    ttft: float = 0.0  # seconds
    e2e: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        if self.output_len < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_len - 1)


async def send_request(http: httpx.AsyncClient, base_url: str, model: str,
                       req: BenchRequest) -> RequestResult:
    """One streaming /v1/completions request; timings from the SSE chunks."""
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.output_len,
            "min_tokens": req.output_len, "ignore_eos": True, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True}
    res = RequestResult(req.index, input_len=req.input_len)
    res.start = t0 = time.perf_counter()
    last = t0
    n_tokens = 0
    usage: dict[str, Any] | None = None
    try:
        async with http.stream("POST", base_url + "/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"])[:300]
                    return res
                if chunk.get("usage"):
                    usage = chunk["usage"]
                now = time.perf_counter()
                got = 0
                for c in chunk.get("choices") or []:
                    ids = c.get("token_ids")
                    got += len(ids) if ids is not None else (1 if c.get("text") else 0)
                if not got:
                    continue
                if n_tokens == 0:
                    res.ttft = now - t0
                else:
                    res.itl.append(now - last)
                last = now
                n_tokens += got
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"[:300]
        return res
    res.e2e = time.perf_counter() - t0
    if usage:
        res.input_len = usage.get("prompt_tokens", res.input_len)
        n_tokens = usage.get("completion_tokens", n_tokens)
    res.output_len = n_tokens
    res.ok = n_tokens > 0
    if not res.ok:
        res.error = "no tokens"
    return res


class Progress:
    """A one-line progress bar on stderr, only when stderr is a terminal."""

    def __init__(self, total: int, label: str) -> None:
        self.total, self.label, self.done = total, label, 0
        self.enabled = sys.stderr.isatty()
        self.t0 = time.perf_counter()

    def update(self, n: int = 1) -> None:
        self.done += n
        if not self.enabled:
            return
        width = 30
        filled = int(width * self.done / max(1, self.total))
        elapsed = time.perf_counter() - self.t0
        sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] "
                         f"{self.done}/{self.total} {elapsed:6.1f}s")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


async def run_load(base_url: str, model: str, requests: list[BenchRequest],
                   request_rate: float, concurrency: int | None, seed: int = 0,
                   label: str = "bench") -> tuple[list[RequestResult], float]:
    """Send `requests` on the arrival schedule, at most `concurrency` in flight.
    Returns the results and the wall time from the first send to the last completion."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(600.0, connect=30.0)
    sem = asyncio.Semaphore(concurrency) if concurrency else None
    progress = Progress(len(requests), label)
    offsets = arrival_offsets(len(requests), request_rate, seed)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as http:
        t0 = time.perf_counter()

        async def one(req: BenchRequest, at: float) -> RequestResult:
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is None:
                res = await send_request(http, base_url, model, req)
            else:
                async with sem:
                    res = await send_request(http, base_url, model, req)
            progress.update()
            return res

        results = await asyncio.gather(*(one(r, at) for r, at in zip(requests, offsets)))
        duration = time.perf_counter() - t0
    progress.close()
    return list(results), duration


async def resolve_model(base_url: str) -> str:
    async with httpx.AsyncClient(timeout=30.0, trust_env=False) as http:
        r = await http.get(base_url + "/models")
        r.raise_for_status()
        return r.json()["data"][0]["id"]
