"""A PD cluster on namespace hosts (netns_lab.NetLab) and the streaming load its fault tests
run: etcd and the service on `ctl`, the prefill on subnet A, the decodes on subnet B, KV
over UCX restricted to TCP (no shared memory, no pool mapping) or the TCP backend.

`Load` runs greedy streams through the service from this machine and sorts every request
into exact (the reference tokens), a clean error (an OpenAI-shaped error, the tokens before
it a prefix of the reference), wrong (any other token, or one twice) or hung (not ended
within the bound); `Tally` is one fault's line of figures.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import pathlib
import re
import time

import httpx

from benchmarks.netns_lab import NetLab
from xllm_py.utils.config_file import write_settings
from xllm_py.utils.procs import ChildProcess

HTTP_PORT = 8000  # every host has its own ports
ETCD_PORT = 2379
UCX_OVER_TCP = {"UCX_TLS": "self,tcp", "XLLM_UCX_IOV_TLS": "self,tcp", "XLLM_UCX_MAP": "0",
                "UCX_NET_DEVICES": "eth0"}
TTL_S = 2.0      # engines' etcd lease
GRACE_S = 1.0    # the service's eviction grace
BLOCK = 8
# Streams must outlast a fault (seconds): the 3M-parameter "tiny" writes 800 tokens in about
# a second here, the 25M one ~20 ms a token.
MODEL = "tiny-25m"


def _get(url: str, timeout: float = 3.0) -> httpx.Response:
    return httpx.get(url, timeout=timeout, trust_env=False)


def metric(url: str, name: str, labels: str = "") -> float:
    text = _get(url + "/metrics").text
    m = re.search(rf"^{name}{re.escape(labels)} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else -1.0


class NetCluster:
    def __init__(self, lab: NetLab, log_dir, backend: str = "ucx", num_decodes: int = 2,
                 mode: str = "PULL") -> None:
        self.lab, self.log_dir, self.backend, self.mode = lab, log_dir, backend, mode
        self.procs: dict[str, ChildProcess] = {}
        self.refs: dict[tuple[str, int], list[int]] = {}  # (prompt, max_tokens) -> tokens
        self.ctl = lab.hosts["ctl"]
        self.etcd = f"{self.ctl}:{ETCD_PORT}"
        lab.add_host("p0", "a")
        self.decodes = [f"d{i}" for i in range(num_decodes)]
        for d in self.decodes:
            lab.add_host(d, "b")
        self.procs["etcd"] = lab.spawn("ctl", "etcd", "xllm_py.cluster.etcd_server",
                                       ["--host", self.ctl, "--port", str(ETCD_PORT)], log_dir)
        self.svc_url = f"http://{self.ctl}:{HTTP_PORT}"
        self.procs["service"] = lab.spawn(
            "ctl", "service", "xllm_service",
            ["--etcd", self.etcd, "--host", self.ctl, "--http-port", str(HTTP_PORT),
             "--rpc-port", "8001", "--model", MODEL, "--etcd-ttl", str(TTL_S),
             *write_settings(pathlib.Path(log_dir) / "service.settings.yaml",
                             {"evict_grace_s": GRACE_S, "rpc_timeout": 3}),
             "--load-balance-policy", "LEAST_LOAD"],  # (PD always)
            log_dir, http_url=self.svc_url)
        self.start_engine("p0")
        for d in self.decodes:
            self.start_engine(d)

    def url(self, host: str) -> str:
        return f"http://{self.lab.hosts[host]}:{HTTP_PORT}"

    def start_engine(self, host: str) -> ChildProcess:
        role = "PREFILL" if host.startswith("p") else "DECODE"
        addr = self.lab.hosts[host]
        settings = write_settings(pathlib.Path(self.log_dir) / f"{host}.settings.yaml", {
            "etcd_ttl": TTL_S, "heart_beat_interval": 0.3, "rpc_timeout": 3, "num_threads": 1,
            # every request moves its whole KV (no prefix hit from the reference run)
            "enable_prefix_cache": False, "latency_profile": "off"})
        args = ["--instance-role", role, "--model", MODEL, "--host", addr,
                "--port", str(HTTP_PORT), "--etcd", self.etcd, "--block-size", str(BLOCK),
                "--num-blocks", "512", "--kv-transfer-backend", self.backend,
                "--kv-cache-transfer-mode", self.mode, "--instance-name", host, *settings]
        env = UCX_OVER_TCP if self.backend == "ucx" else {}
        proc = self.lab.spawn(host, host, "xllm_py.engine", args, self.log_dir,
                              http_url=self.url(host), env=env)
        self.procs[host] = proc
        return proc

    def engines(self) -> list[str]:
        return ["p0", *self.decodes]

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        for host in self.engines():
            self.procs[host].wait_ready(timeout_s)
        self.procs["service"].wait_ready(60, path="/readiness")
        self.wait_active(len(self.engines()), 30)

    def active(self) -> int:
        return int(metric(self.svc_url, "xllm_service_instances", '{state="ACTIVE"}'))

    def registered(self) -> int:
        """Instances the service knows in any state (an evicted one is gone)."""
        text = _get(self.svc_url + "/metrics").text
        return int(sum(float(v) for v in re.findall(
            r'^xllm_service_instances\{state="\w+"\} ([0-9.]+)$', text, re.M)))

    def wait_active(self, n: int, timeout_s: float) -> float:
        t0 = time.monotonic()
        while self.active() != n:
            if time.monotonic() - t0 > timeout_s:
                raise AssertionError(f"the service sees {self.active()} ACTIVE instances, "
                                     f"not {n}, after {timeout_s:.0f}s")
            time.sleep(0.1)
        return time.monotonic() - t0

    def blocks_used(self) -> dict[str, int]:
        out = {}
        for host in self.engines():
            if not self.procs[host].alive():
                continue  # drained or killed: it holds nothing
            try:
                out[host] = int(metric(self.url(host), "xllm_kv_cache_blocks_used")
                                + metric(self.url(host), "xllm_requests_running"))
            except httpx.HTTPError:
                out[host] = -1  # unreachable (a cut link, a killed process)
        return out

    def wait_pools_empty(self, timeout_s: float) -> dict[str, int]:
        """What every engine still holds (KV blocks + running requests) once all are 0 or
        `timeout_s` has passed."""
        t0 = time.monotonic()
        while True:
            left = self.blocks_used()
            if all(v == 0 for v in left.values()) or time.monotonic() - t0 > timeout_s:
                return left
            time.sleep(0.2)

    def stop(self) -> None:
        for name in reversed(list(self.procs)):
            self.procs[name].terminate(5)


# ---------------------------------------------------------------------- the load
@dataclasses.dataclass
class Run:
    prompt: str
    ids: list[int] = dataclasses.field(default_factory=list)
    times: list[float] = dataclasses.field(default_factory=list)
    error: str | None = None    # a clean, OpenAI-shaped error
    unclean: str | None = None  # anything else that ended it
    done: bool = False
    hung: bool = False
    started: float = 0.0
    ended: float = 0.0

    @property
    def max_pause(self) -> float:
        return max((b - a for a, b in zip(self.times, self.times[1:])), default=0.0)


async def stream(http: httpx.AsyncClient, url: str, run: Run, max_tokens: int) -> None:
    body = {"model": MODEL, "prompt": run.prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True, "return_token_ids": True}
    run.started = run.started or time.monotonic()
    try:
        async with http.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                try:
                    run.error = json.loads(text)["error"]["message"] or "(empty message)"
                except (ValueError, KeyError, TypeError):
                    run.unclean = f"HTTP {resp.status_code}: {text[:200]}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    run.done = run.error is None
                    return
                event = json.loads(data)
                if "error" in event:
                    run.error = event["error"].get("message") or "(empty message)"
                    continue
                for choice in event.get("choices", []):
                    ids = choice.get("token_ids") or []
                    if ids:
                        run.ids += ids
                        run.times.append(time.monotonic())
        run.unclean = run.unclean or "the stream ended without [DONE]"
    except httpx.HTTPError as exc:
        run.unclean = f"{type(exc).__name__}: {exc}"
    finally:
        run.ended = time.monotonic()


@dataclasses.dataclass
class Tally:
    fault: str
    requests: int = 0
    exact: int = 0
    errors: int = 0
    hung: int = 0
    wrong: int = 0
    cancelled: int = 0
    blocks_left: int = 0
    pause_s: float = 0.0
    notes: list[str] = dataclasses.field(default_factory=list)

    def line(self) -> str:
        extra = f", cancelled {self.cancelled}" if self.cancelled else ""
        return (f"[{self.fault}] requests {self.requests}, exact {self.exact}, clean errors "
                f"{self.errors}, hung {self.hung}, wrong {self.wrong}{extra}, blocks left "
                f"{self.blocks_left}, longest pause {self.pause_s:.1f}s")


class Load:
    """Greedy streams through the service; `refs` the tokens of an undisturbed run."""

    def __init__(self, cluster: NetCluster, prompts: list[str], max_tokens: int,
                 bound_s: float) -> None:
        self.cluster, self.prompts, self.max_tokens = cluster, prompts, max_tokens
        self.bound_s = bound_s
        self.refs: dict[str, list[int]] = {}
        self.runs: list[Run] = []
        self.cancelled: set[int] = set()
        self._tasks: list[asyncio.Task] = []
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(bound_s, connect=5.0),
                                      trust_env=False)

    async def reference(self) -> None:
        """The tokens of an undisturbed run of each prompt (kept on the cluster: the
        module's tests share prompts)."""
        cache = self.cluster.refs
        runs = [Run(p) for p in self.prompts if (p, self.max_tokens) not in cache]
        await asyncio.gather(*(stream(self.http, self.cluster.svc_url, r, self.max_tokens)
                               for r in runs))
        for r in runs:
            assert r.done and len(r.ids) == self.max_tokens, (r.error, r.unclean)
            cache[(r.prompt, self.max_tokens)] = r.ids
        self.refs = {p: cache[(p, self.max_tokens)] for p in self.prompts}

    def start(self, prompt: str, cancel_after_s: float | None = None) -> Run:
        """A stream of `prompt`; `cancel_after_s`: the client hangs up then (wherever the
        request is: queued, prefilling, handing over, decoding)."""
        run = Run(prompt, started=time.monotonic())
        task = asyncio.create_task(stream(self.http, self.cluster.svc_url, run,
                                          self.max_tokens))
        if cancel_after_s is not None:
            self.cancelled.add(len(self.runs))
            asyncio.get_running_loop().call_later(cancel_after_s, task.cancel)
        self.runs.append(run)
        self._tasks.append((task, run))
        return run

    async def finish(self) -> None:
        """Every request ended, or marked hung at the bound."""
        deadline = max(r.started for r in self.runs) + self.bound_s
        pending = {t: run for t, run in self._tasks if not t.done()}
        if pending:
            _, still = await asyncio.wait(pending, timeout=max(0.1, deadline - time.monotonic()))
            for t in still:
                pending[t].hung = True
                t.cancel()
        await asyncio.gather(*(t for t, _ in self._tasks), return_exceptions=True)
        self._tasks = []

    def tally(self, fault: str, settle_s: float = 20.0) -> Tally:
        t = Tally(fault, requests=len(self.runs))
        for i, run in enumerate(self.runs):
            ref = self.refs[run.prompt]
            prefix_ok = run.ids == ref[:len(run.ids)]
            if i in self.cancelled and not run.done:
                t.cancelled += 1
                if not prefix_ok:
                    t.wrong += 1
                    t.notes.append(f"cancelled run {i} got tokens off the reference")
            elif run.hung:
                t.hung += 1
                t.notes.append(f"run {i} hung with {len(run.ids)} tokens")
            elif not prefix_ok or run.unclean or (run.done and run.ids != ref):
                t.wrong += 1
                t.notes.append(f"run {i}: {len(run.ids)} tokens, prefix ok {prefix_ok}, "
                               f"{run.unclean or run.error or 'done'}")
            elif run.done:
                t.exact += 1
            else:
                t.errors += 1
                t.notes.append(f"run {i} error after {len(run.ids)} tokens: {run.error}")
            if i not in self.cancelled:
                t.pause_s = max(t.pause_s, run.max_pause)
        left = self.cluster.wait_pools_empty(settle_s)
        t.blocks_left = sum(v for v in left.values() if v > 0)
        if t.blocks_left:
            t.notes.append(f"left per engine (blocks + running): {left}")
        return t

    async def close(self) -> None:
        await self.http.aclose()


def prompts(n: int, words: int = 6, offset: int = 0) -> list[str]:
    vocab = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi "
             "omicron pi rho sigma tau upsilon phi chi psi omega").split()
    return [f"Request {offset + i}: " + " ".join(vocab[(offset + i * 7 + k) % len(vocab)]
                                               for k in range(words)) for i in range(n)]
