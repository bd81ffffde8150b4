"""Processes of a test cluster (service + engines) on one etcd, torn down after the test."""
from __future__ import annotations

import asyncio
import pathlib
import re
import time

import httpx
import openai

from xllm_py.utils.procs import ChildProcess, engine_args, free_port, spawn


class Harness:
    def __init__(self, etcd_endpoint: str, namespace: str, log_dir: pathlib.Path,
                 ttl_s: float = 2.0) -> None:
        self.etcd = etcd_endpoint
        self.namespace = namespace
        self.log_dir = log_dir
        self.ttl_s = ttl_s
        self.procs: list[ChildProcess] = []

    def service(self, name: str = "service", evict_grace_s: float = 2.0,
                extra: list[str] | None = None) -> ChildProcess:
        http, rpc = free_port(), free_port()
        proc = spawn(name, "xllm_service",
                     ["--etcd", self.etcd, "--etcd-namespace", self.namespace,
                      "--etcd-ttl", str(self.ttl_s), "--http-port", str(http),
                      "--rpc-port", str(rpc), "--evict-grace-s", str(evict_grace_s),
                      *(extra or [])],
                     self.log_dir, http_url=f"http://127.0.0.1:{http}")
        self.procs.append(proc)
        return proc

    def engine(self, role: str, name: str, port: int | None = None,
               extra: list[str] | None = None) -> ChildProcess:
        port = port or free_port()
        args = engine_args(role, port, etcd=self.etcd, extra=[
            "--etcd-namespace", self.namespace, "--etcd-ttl", str(self.ttl_s),
            "--heart-beat-interval", "0.3", *(extra or [])])
        proc = spawn(name, "xllm_py.engine", args, self.log_dir,
                     http_url=f"http://127.0.0.1:{port}")
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.terminate()


def client(proc: ChildProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=proc.http_url + "/v1", api_key="x", max_retries=0,
                         timeout=60)


def aclient(proc: ChildProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=proc.http_url + "/v1", api_key="x", max_retries=0,
                              timeout=60)


async def long_stream(c: openai.AsyncOpenAI, prompt: str,
                      max_tokens: int = 1500) -> tuple[str, float]:
    """Stream a long greedy completion; returns ("completed" | "error: ...", end time)."""
    try:
        stream = await c.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                            temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
        async for _ in stream:
            pass
        return "completed", time.monotonic()
    except openai.APIError as exc:
        return f"error: {exc}", time.monotonic()


async def wait_until(pred, timeout_s: float, step_s: float = 0.02) -> float:
    """Seconds until pred() is true; fails the test on timeout."""
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"condition not met within {timeout_s}s")
        await asyncio.sleep(step_s)
    return time.monotonic() - t0


def metric(url: str, name: str) -> float:
    """An unlabelled sample from a process's /metrics."""
    text = httpx.get(url + "/metrics", timeout=5, trust_env=False).text
    m = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name} not in {url}/metrics"
    return float(m.group(1))


async def drop_stream_after_first_chunk(url: str, prompt: str = "Hello",
                                        max_tokens: int = 1800) -> None:
    """Start a long streaming completion and hang up after its first event."""
    async with httpx.AsyncClient(base_url=url, timeout=30, trust_env=False) as http:
        async with http.stream("POST", "/v1/completions", json={
                "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                "ignore_eos": True}) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data:"):
                    break


async def wait_drained(urls: list[str], timeout_s: float = 5.0) -> float:
    """Seconds until every engine has no used KV block and no running request."""
    return await wait_until(
        lambda: all(metric(u, "xllm_kv_cache_blocks_used") == 0
                    and metric(u, "xllm_requests_running") == 0 for u in urls),
        timeout_s, step_s=0.1)
