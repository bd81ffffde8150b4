"""python -m xllm_py.launch end to end: up, serve (openai client and the printed curl),
SIGTERM, and nothing left behind (engines, service, etcd)."""
from __future__ import annotations

import asyncio
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

import grpc
import openai
import pytest

from xllm_py.proto import xllm_pb2, xllm_pb2_grpc
from xllm_py.utils.procs import free_port

pytestmark = pytest.mark.integration

READY_TIMEOUT_S = 240.0
EXIT_TIMEOUT_S = 15.0


def _proc_table() -> dict[int, tuple[int, str]]:
    """pid -> (ppid, cmdline) for every process we can read."""
    table: dict[int, tuple[int, str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = pathlib.Path(f"/proc/{entry}/stat").read_text()
            cmd = pathlib.Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        # the command name (field 2) may hold spaces and parentheses: split after the last ')'
        fields = stat[stat.rfind(")") + 2:].split()
        if fields[0] == "Z":  # a zombie has exited; it only waits to be reaped
            continue
        table[int(entry)] = (int(fields[1]), cmd.replace(b"\0", b" ").decode(errors="replace"))
    return table


def _related(root: int, markers: list[str]) -> dict[int, str]:
    """Descendants of `root` plus processes whose command line names one of `markers`."""
    table = _proc_table()
    found: dict[int, str] = {}
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, cmd) in table.items():
            if ppid == parent and pid not in found:
                found[pid] = cmd
                frontier.append(pid)
    for pid, (_, cmd) in table.items():
        if pid != root and pid != os.getpid() and any(m in cmd for m in markers):
            found.setdefault(pid, cmd)
    return found


class _StdoutReader(threading.Thread):
    """Collects the launcher's stdout lines so the test can wait for the banner."""

    def __init__(self, stream) -> None:
        super().__init__(daemon=True)
        self.stream = stream
        self.lines: list[str] = []
        self.cond = threading.Condition()

    def run(self) -> None:
        for raw in self.stream:
            with self.cond:
                self.lines.append(raw.rstrip("\n"))
                self.cond.notify_all()
        with self.cond:
            self.lines.append("<EOF>")
            self.cond.notify_all()

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match | None:
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while True:
                for line in self.lines:
                    m = re.search(pattern, line)
                    if m:
                        return m
                if "<EOF>" in self.lines or time.monotonic() > deadline:
                    return None
                self.cond.wait(0.5)


def _log_tails(log_dir: pathlib.Path, n: int = 30) -> str:
    out = []
    for path in sorted(log_dir.glob("*.log")):
        lines = path.read_text(errors="replace").splitlines()[-n:]
        out.append(f"--- {path.name}\n" + "\n".join(lines))
    return "\n".join(out)


@pytest.fixture
def launcher(tmp_path, request):
    extra = getattr(request, "param", [])  # more launcher flags (indirect parametrization)
    log_dir = tmp_path / "logs"
    http_port = free_port()
    stderr = open(tmp_path / "launcher.stderr", "wb")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "xllm_py.launch", "--model", "tiny", "--http-port", str(http_port),
         "--log-dir", str(log_dir), *extra],
        stdout=subprocess.PIPE, stderr=stderr, stdin=subprocess.DEVNULL, text=True, env=env)
    reader = _StdoutReader(proc.stdout)
    reader.start()
    markers = [str(log_dir), f"--http-port {http_port}"]
    seen: dict[int, str] = {}
    try:
        yield proc, reader, log_dir, http_port, markers, seen
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        # last resort, so a failed test leaves nothing behind: only pids seen as ours
        for pid, cmd in {**seen, **_related(proc.pid, markers)}.items():
            try:
                if _proc_table().get(pid, (0, ""))[1] == cmd:
                    os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        stderr.close()


def test_launch_serves_and_stops_cleanly(launcher, tmp_path) -> None:
    proc, reader, log_dir, http_port, markers, seen = launcher

    m = reader.wait_for(r"OpenAI endpoint:\s+(\S+)", READY_TIMEOUT_S)
    assert m, ("launcher printed no endpoint; stdout:\n" + "\n".join(reader.lines) +
               "\nstderr:\n" + (tmp_path / "launcher.stderr").read_text(errors="replace") +
               "\n" + (_log_tails(log_dir) if log_dir.exists() else ""))
    base_url = m.group(1)
    assert base_url == f"http://127.0.0.1:{http_port}/v1"
    curl = reader.wait_for(r"^\s*(curl .*)$", 5)
    assert curl, "\n".join(reader.lines)
    assert reader.wait_for(r"Ctrl-C stops everything", 5)

    # the processes it started: 1 prefill, 1 decode, the service and etcd
    seen.update(_related(proc.pid, markers))
    cmds = list(seen.values())
    assert sum("xllm_py.engine" in c and "PREFILL" in c for c in cmds) == 1, cmds
    assert sum("xllm_py.engine" in c and "DECODE" in c for c in cmds) == 1, cmds
    assert sum("-m xllm_service" in c for c in cmds) == 1, cmds
    assert sum("etcd" in c.split(" ", 1)[0] for c in cmds) == 1, cmds

    # the official client
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
    models = client.models.list()
    model = models.data[0].id
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hello!"}], max_tokens=16,
        temperature=0)
    assert chat.choices[0].finish_reason in ("length", "stop")
    assert chat.usage.completion_tokens >= 1
    assert chat.choices[0].message.role == "assistant"
    streamed = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hello!"}], max_tokens=16,
        temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == chat.choices[0].message.content  # greedy: same text both ways

    # the printed curl, as pasted into a shell
    out = subprocess.run(["bash", "-c", curl.group(1) + " --silent --show-error --max-time 60"],
                         capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    body = json.loads(out.stdout)
    assert body["object"] == "text_completion", body
    assert body["model"] == model
    assert body["choices"][0]["text"]
    assert 1 <= body["usage"]["completion_tokens"] <= 24

    # SIGTERM: the launcher exits and takes every child with it (etcd included)
    seen.update(_related(proc.pid, markers))
    proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + EXIT_TIMEOUT_S
    while time.monotonic() < deadline:
        alive = {p: c for p, c in seen.items() if _proc_table().get(p, (0, ""))[1] == c}
        if proc.poll() is not None and not alive:
            break
        time.sleep(0.2)
    alive = {p: c for p, c in seen.items() if _proc_table().get(p, (0, ""))[1] == c}
    assert proc.poll() is not None, f"launcher still running {EXIT_TIMEOUT_S}s after SIGTERM"
    assert not alive, f"left behind after SIGTERM: {alive}"
    assert proc.returncode == 0
    assert not _related(proc.pid, markers)
    assert reader.wait_for(r"<EOF>", 5)
    # nothing a user reads as trouble: no request log lines of the readiness polls, no
    # engine heartbeat to a service already gone, no master "losing" its role at shutdown
    launcher_err = (tmp_path / "launcher.stderr").read_text(errors="replace").splitlines()
    assert not [ln for ln in reader.lines + launcher_err if "httpx" in ln], launcher_err
    noise = [ln for log in log_dir.glob("*.log") for ln in log.read_text().splitlines()
             if ("heartbeat" in ln and "UNAVAILABLE" in ln) or "no longer the master" in ln
             or ("WARNING" in ln and "evicted" in ln)]
    assert not noise, noise


@pytest.mark.parametrize("launcher", [["--tls", "--api-key", "sk-launch-test"]], indirect=True)
def test_launch_tls_and_api_key(launcher, tmp_path) -> None:
    """--tls: certificates in the log dir, etcd and every gRPC port refuse plaintext; the
    API needs the key (the banner's curl says how), which is in no command line or log."""
    proc, reader, log_dir, http_port, markers, seen = launcher
    m = reader.wait_for(r"OpenAI endpoint:\s+(\S+)", READY_TIMEOUT_S)
    assert m, ("no endpoint; stdout:\n" + "\n".join(reader.lines) + "\n" +
               (tmp_path / "launcher.stderr").read_text(errors="replace"))
    assert reader.wait_for(r"etcd:.*\(mutual TLS\)", 5)
    assert reader.wait_for(r"curl .*Authorization: Bearer <your --api-key>", 5)
    assert {p.name for p in (log_dir / "certs").iterdir()} >= {"ca.pem", "etcd.pem", "service.pem",
                                                                 "engine.pem", "engine-key.pem"}
    base_url = m.group(1)
    denied = openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError):
        denied.models.list()
    client = openai.OpenAI(base_url=base_url, api_key="sk-launch-test", max_retries=0, timeout=60)
    chat = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=[{"role": "user", "content": "Hello!"}],
        max_tokens=8, temperature=0)
    assert chat.usage.completion_tokens >= 1  # through prefill and decode, over mutual TLS
    seen.update(_related(proc.pid, markers))
    cmds = list(seen.values())
    assert all("sk-launch-test" not in c for c in cmds), cmds
    service = next(c for c in cmds if "-m xllm_service" in c)
    assert "--tls-cert" in service and "--api-key-file" in service
    rpc = re.search(r"--rpc-port (\d+)", service).group(1)

    async def plaintext_call() -> grpc.StatusCode:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{rpc}") as ch:
            try:
                await xllm_pb2_grpc.XllmRpcServiceStub(ch).GetStaticDecodeList(
                    xllm_pb2.InstanceID(name="x"), timeout=5)
            except grpc.aio.AioRpcError as exc:
                return exc.code()
        return grpc.StatusCode.OK

    assert asyncio.run(plaintext_call()) == grpc.StatusCode.UNAVAILABLE
    for log in log_dir.glob("*.log"):
        assert "sk-launch-test" not in log.read_text(errors="replace"), log.name
