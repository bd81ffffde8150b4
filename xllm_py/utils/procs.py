"""Child processes of the cluster (engines, services): start, wait until ready, stop.

Used by the one-command launcher and by the integration tests, so both bring processes
up and down the same way.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import random
import signal
import socket
import subprocess
import sys
import time
from typing import Sequence

import httpx

from xllm_py.config import child_env

logger = logging.getLogger(__name__)


GUARD_SCRIPT = pathlib.Path(__file__).with_name("guarded_exec.py")


def guarded(argv: list[str], cpu: int | Sequence[int] | None = None) -> list[str]:
    """`argv` wrapped so that it gets SIGTERM when this process dies and runs on `cpu` (a
    core or several; Linux): see guarded_exec.py for why this is not a preexec_fn."""
    cpus = "-" if cpu is None else str(cpu) if isinstance(cpu, int) else ",".join(map(str, cpu))
    return [sys.executable, "-S", str(GUARD_SCRIPT), str(os.getpid()), cpus, *argv]


_handed_out: set[int] = set()
_rng = random.Random(os.getpid() ^ time.monotonic_ns())


def _ephemeral_low(default: int = 32768) -> int:
    """Low end of the kernel's range for outgoing connections' local ports."""
    try:
        return int(pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return default


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now, for a child to listen on.

    Picked at random below the ephemeral range, where no outgoing connection takes a local
    port between this check and the child's bind, and never one this process handed out
    before (two calls in a row can otherwise get the same port back from bind(0)).
    """
    high = min(_ephemeral_low(), 65536)
    low = max(1024, high - 12000)
    for _ in range(200):
        port = _rng.randrange(low, high)
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # a crowded range
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class ChildProcess:
    name: str
    argv: list[str]
    log_path: pathlib.Path
    popen: subprocess.Popen
    http_url: str | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float = 120.0, path: str = "/health") -> None:
        """Wait until GET http_url+path answers 200; raise with the log tail otherwise."""
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited with {self.popen.returncode}:\n"
                                   f"{self.log_tail()}")
            try:
                r = httpx.get(self.http_url + path, timeout=1.0, trust_env=False)
                if r.status_code == 200:
                    return
                last = f"{r.status_code} {r.text[:200]}"
            except httpx.HTTPError as exc:
                last = repr(exc)
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} not ready after {timeout_s:.0f}s ({last}):\n"
                           f"{self.log_tail()}")

    def terminate(self, timeout_s: float = 10.0) -> int | None:
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        return self.popen.returncode

    def kill(self) -> None:
        if self.alive():
            self.popen.kill()
            self.popen.wait(5)


def spawn(name: str, module: str, args: list[str], log_dir: pathlib.Path,
          http_url: str | None = None, env: dict[str, str] | None = None,
          cpu: int | Sequence[int] | None = None) -> ChildProcess:
    """python -m <module> <args>, output to <log_dir>/<name>.log. `cpu` pins it to one core
    or several (Linux)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    argv = [sys.executable, "-m", module, *args]
    full_env = child_env()
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    if env:
        full_env.update(env)
    with open(log_path, "ab") as log:
        popen = subprocess.Popen(guarded(argv, cpu), stdout=log, stderr=subprocess.STDOUT,
                                 env=full_env, stdin=subprocess.DEVNULL, start_new_session=True)
    logger.info("started %s (pid %d), log %s", name, popen.pid, log_path)
    return ChildProcess(name, argv, log_path, popen, http_url)


def engine_args(role: str, port: int, *, etcd: str | None = None, model: str = "tiny",
                host: str = "127.0.0.1", extra: list[str] | None = None) -> list[str]:
    args = ["--instance-role", role, "--model", model, "--host", host, "--port", str(port)]
    if etcd:
        args += ["--etcd", etcd]
    return args + list(extra or [])
