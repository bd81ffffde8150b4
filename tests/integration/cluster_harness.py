"""Processes of a test cluster (service + engines) on one etcd, torn down after the test."""
from __future__ import annotations

import asyncio
import pathlib
import re
import time

import httpx
import openai

from tests.waiting import wait_until  # noqa: F401  (re-exported: the cluster tests import it from here)
from xllm_py.utils.config_file import write_settings
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
                extra: list[str] | None = None, pd_always: bool = True,
                settings: dict[str, object] | None = None) -> ChildProcess:
        """`pd_always`: LEAST_LOAD, every prompt on a prefill (the tests of the PD
        machinery; a policy in `extra` wins); False: the service's own defaults.
        `settings`: more of its --config FILE (evict_grace_s is there already)."""
        http, rpc = free_port(), free_port()
        config = write_settings(self.log_dir / f"{name}.settings.yaml",
                                {"evict_grace_s": evict_grace_s, **(settings or {})})
        proc = spawn(name, "xllm_service",
                     ["--model", "tiny", "--etcd", self.etcd, "--etcd-namespace", self.namespace,
                      "--etcd-ttl", str(self.ttl_s), "--http-port", str(http),
                      "--rpc-port", str(rpc), *config,
                      *(["--load-balance-policy", "LEAST_LOAD"] if pd_always else []),
                      *(extra or [])],
                     self.log_dir, http_url=f"http://127.0.0.1:{http}")
        self.procs.append(proc)
        return proc

    def engine(self, role: str, name: str, port: int | None = None,
               extra: list[str] | None = None, profile: bool = False,
               settings: dict | None = None, fault: str | None = None) -> ChildProcess:
        """`profile`: a PREFILL / DECODE measures its latency profile at start-up, as by
        default (else none, unless `settings` names a file: the tests of the PD
        machinery); `settings`: more of its settings file (python -m xllm_py.engine --help);
        `fault`: the engine runs with that fault installed (faulty_engine.py)."""
        port = port or free_port()
        file = write_settings(self.log_dir / f"{name}.settings.yaml", {
            "etcd_ttl": self.ttl_s, "heart_beat_interval": 0.3,
            **({} if profile else {"latency_profile": "off"}), **(settings or {})})
        args = engine_args(role, port, etcd=self.etcd, extra=[
            "--etcd-namespace", self.namespace, *file, *(extra or [])])
        module = "xllm_py.engine" if fault is None else "tests.integration.faulty_engine"
        proc = spawn(name, module, args if fault is None else [fault, *args], self.log_dir,
                     http_url=f"http://127.0.0.1:{port}")
        self.procs.append(proc)
        return proc

    def pd_tp_cluster(self, common: list[str], p_tp: int, d_tp: int,
                      service_extra: list[str] | None = None,
                      service_settings: dict[str, object] | None = None):
        """A service (flags `service_extra`, settings `service_settings`) with one PREFILL of
        TP `p_tp` and one DECODE of TP `d_tp` (engine flags `common`), all ready: (service,
        prefill, decode)."""
        svc = self.service(extra=service_extra, settings=service_settings)
        prefill = self.engine("PREFILL", "prefill", extra=[*common, "--tp", str(p_tp)])
        decode = self.engine("DECODE", "decode", extra=[*common, "--tp", str(d_tp)])
        for p in (prefill, decode):
            p.wait_ready(240)
        svc.wait_ready(60, path="/readiness")
        return svc, prefill, decode

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.terminate()


def standalone_mix(log_dir: pathlib.Path, extra: list[str]) -> ChildProcess:
    """A MIX engine of its own (no etcd, no service) on a free port; not yet ready."""
    port = free_port()
    return spawn("engine-mix", "xllm_py.engine", engine_args("MIX", port, extra=extra),
                 log_dir, http_url=f"http://127.0.0.1:{port}")


def client(proc: ChildProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=proc.http_url + "/v1", api_key="x", max_retries=0,
                         timeout=60)


def aclient(proc: ChildProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=proc.http_url + "/v1", api_key="x", max_retries=0,
                              timeout=60)


async def long_stream(c: openai.AsyncOpenAI, prompt: str, max_tokens: int = 1500,
                      n: int = 1) -> tuple[str, float]:
    """Stream a long greedy completion; returns ("completed" | "error: ...", end time)."""
    try:
        stream = await c.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                            n=n, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
        async for _ in stream:
            pass
        return "completed", time.monotonic()
    except openai.APIError as exc:
        return f"error: {exc}", time.monotonic()


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


def labelled(url: str, name: str, labels: str) -> int:
    """A labelled counter or gauge from a process's /metrics (-1 when absent), e.g.
    labelled(svc, "xllm_service_instances", 'state="ACTIVE"')."""
    text = httpx.get(url + "/metrics", timeout=5, trust_env=False).text
    m = re.search(rf"^{name}{{{re.escape(labels)}}} (\d+)(?:\.0)?$", text, re.M)
    return int(m.group(1)) if m else -1


def migrations(svc: ChildProcess, outcome: str) -> int:
    n = labelled(svc.http_url, "xllm_service_migrations_total", f'outcome="{outcome}"')
    assert n >= 0, "xllm_service_migrations_total not in the service's /metrics"
    return n


def start_mix_cluster(h: Harness, num_engines: int = 2) -> tuple[ChildProcess, list[ChildProcess]]:
    """The service and `num_engines` MIX engines, all known to the service as ACTIVE."""
    svc = h.service()
    engines = [h.engine("MIX", f"mix-{i}") for i in range(num_engines)]
    for e in engines:
        e.wait_ready(180)
    svc.wait_ready(60, path="/readiness")
    deadline = time.monotonic() + 30
    while labelled(svc.http_url, "xllm_service_instances", 'state="ACTIVE"') != num_engines:
        assert time.monotonic() < deadline, "the service does not see every engine ACTIVE"
        time.sleep(0.1)
    return svc, engines


COMPLETE_AFTER_KILL_S = 120


async def kill_mid_stream_and_check_migration(
        svc: ChildProcess, engines: list[ChildProcess], prompts: list[str], max_tokens: int,
        pause_bound_s: float, extra_body: dict | None = None) -> ChildProcess:
    """Greedy streams through the service; SIGKILL the engine of `engines` that runs the
    most of them (judged by the engines: on a loaded machine the client lags them by
    seconds) once each has a token relayed; then every stream must complete with the
    token ids and text of an uninterrupted run on the survivor, the moves counted in
    xllm_service_migrations_total, no pause longer than `pause_bound_s`. Returns the
    surviving engine. `extra_body`: more request fields (e.g. a structured output)."""
    c = aclient(svc)
    runs = [{"ids": [], "text": "", "times": []} for _ in prompts]
    body = {"ignore_eos": True, "return_token_ids": True, **(extra_body or {})}

    async def one(prompt: str, run: dict) -> None:
        stream = await c.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                            temperature=0, stream=True, extra_body=body)
        async for chunk in stream:
            run["ids"] += chunk.choices[0].model_extra.get("token_ids") or []
            run["text"] += chunk.choices[0].text
            run["times"].append(time.monotonic())

    tasks = [asyncio.create_task(one(p, r)) for p, r in zip(prompts, runs)]

    def running() -> list[float | None]:  # None: that engine does not answer (killed)
        counts = []
        for e in engines:
            try:
                counts.append(metric(e.http_url, "xllm_requests_running"))
            except httpx.HTTPError:
                counts.append(None)
        return counts

    def state() -> str:
        return (f"tokens per stream {[len(r['ids']) for r in runs]}, running {running()}, "
                f"streams done {[t.done() for t in tasks]}")

    # Judged by the engines alone: on a loaded machine the client can lag them by whole
    # streams (it once saw its first tokens only after every stream had ended).
    try:
        await wait_until(lambda: sum(c or 0 for c in running()) == len(runs), 30, step_s=0.05)
    except AssertionError:
        raise AssertionError(f"not every stream running within 30 s: {state()}") from None
    counts = [c or 0 for c in running()]
    victim = engines[counts.index(max(counts))]
    victim.kill()
    num_moved, killed = int(max(counts)), time.monotonic()
    # The bound is for the rest of every stream, generated on the survivor: a hang is
    # caught by it, a slow machine is not (the pause bound below says how fast the move was).
    done, pending = await asyncio.wait(tasks, timeout=COMPLETE_AFTER_KILL_S)
    assert not pending, (f"streams still open {COMPLETE_AFTER_KILL_S} s after the kill: "
                         f"{state()}")
    for t in done:
        t.result()
    pauses = [max(b - a for a, b in zip(r["times"], r["times"][1:])) for r in runs]
    print(f"\n{victim.name} killed with {num_moved} of {len(runs)} streams on it: all "
          f"completed {max(r['times'][-1] for r in runs) - killed:.1f}s after the kill; "
          f"longest pause per stream {[round(p, 1) for p in pauses]}s")
    assert migrations(svc, "ok") == num_moved and migrations(svc, "failed") == 0
    assert max(pauses) < pause_bound_s
    survivor = next(e for e in engines if e is not victim)
    refs = await asyncio.gather(*(c.completions.create(  # on the survivor alone
        model="tiny", prompt=p, max_tokens=max_tokens, temperature=0, extra_body=body)
        for p in prompts))
    for run, ref in zip(runs, (r.choices[0] for r in refs)):
        assert len(run["ids"]) == max_tokens
        assert run["ids"] == ref.model_extra["token_ids"]
        # Also where a move split a UTF-8 character: the new instance emits the bytes the
        # dead one still held back.
        assert run["text"] == ref.text
    return survivor
