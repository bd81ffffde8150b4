"""EmbeddedMooncake: a Mooncake Store on this machine, as the launcher, the tests and the
benchmarks run it: the store's master (the `mooncake_master` the package installs) and a
segment host (segment_host.py) holding the store's memory; metadata in the cluster's etcd,
which outlives a restart of the master (the clients and the segment find each other again).

`kill_master` / `start_master` take the master down and bring it back on the same port
(what a crashed and restarted master looks like to the engines).
"""
from __future__ import annotations

import importlib.util
import logging
import os
import pathlib
import shutil
import socket
import subprocess
import time

from xllm_py.kv_tiers.segment_host import READY
from xllm_py.kv_tiers.store import INSTALL_HINT, load_client_class
from xllm_py.utils.procs import ChildProcess, free_port, guarded, spawn

logger = logging.getLogger(__name__)


def find_master_binary() -> str | None:
    """The `mooncake_master` executable the package ships (its console script is a Python
    wrapper that runs it as a child: a signal to the wrapper would miss the master), else
    one on PATH."""
    spec = importlib.util.find_spec("mooncake")
    for root in (spec.submodule_search_locations or []) if spec else []:
        binary = pathlib.Path(root) / "mooncake_master"
        if binary.is_file() and os.access(binary, os.X_OK):
            return str(binary)
    return shutil.which("mooncake_master")


def store_unavailable() -> str | None:
    """Why no store can run here (one line with what to install), or None."""
    _, why = load_client_class()
    if why is not None:
        return why
    if find_master_binary() is None:
        return f"mooncake_master is not installed: {INSTALL_HINT}"
    return None


class EmbeddedMooncake:
    def __init__(self, etcd_addr: str, log_dir: pathlib.Path, host: str = "127.0.0.1",
                 size_mb: int = 1024, port: int = 0, startup_timeout_s: float = 30.0) -> None:
        self.etcd_addr = etcd_addr
        self.log_dir = pathlib.Path(log_dir)
        self.host = host
        self.size_mb = size_mb
        self.port = port
        self.startup_timeout_s = startup_timeout_s
        self._master: subprocess.Popen | None = None
        self.segment_host: ChildProcess | None = None

    @property
    def master_addr(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def metadata(self) -> str:
        return f"etcd://{self.etcd_addr}"

    def start(self) -> "EmbeddedMooncake":
        self.port = self.port or free_port(self.host)
        self.start_master()
        self.segment_host = spawn(
            "kv-store-segment", "xllm_py.kv_tiers.segment_host",
            ["--master", self.master_addr, "--metadata", self.metadata,
             "--size-mb", str(self.size_mb), "--host", self.host], self.log_dir)
        deadline = time.monotonic() + self.startup_timeout_s
        while READY not in self.segment_host.log_tail(20):
            if not self.segment_host.alive() or time.monotonic() > deadline:
                tail = self.segment_host.log_tail(10)
                self.stop()
                raise RuntimeError(f"the store's segment host did not start:\n{tail}")
            time.sleep(0.05)
        logger.info("Mooncake Store: master %s, %d MB, metadata %s", self.master_addr,
                    self.size_mb, self.metadata)
        return self

    def start_master(self) -> None:
        binary = find_master_binary()
        if binary is None:
            raise RuntimeError(f"mooncake_master is not installed: {INSTALL_HINT}")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / "kv-store-master.log", "ab") as log:
            self._master = subprocess.Popen(
                guarded([binary, f"--rpc_port={self.port}", f"--rpc_address={self.host}",
                         f"--metrics_port={free_port(self.host)}", "--logtostderr"]),
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)  # (a Ctrl-C for the launcher is not for the store)
        deadline = time.monotonic() + self.startup_timeout_s
        while not _listening(self.host, self.port):
            if self._master.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mooncake_master did not start; see {self.log_dir}"
                                   "/kv-store-master.log")
            time.sleep(0.05)

    def kill_master(self) -> None:
        """SIGKILL the master (its blocks are lost; the segment host and the engines stay)."""
        if self._master is not None and self._master.poll() is None:
            self._master.kill()
            self._master.wait(timeout=10)

    def master_alive(self) -> bool:
        return self._master is not None and self._master.poll() is None

    def stop(self) -> None:
        if self.segment_host is not None and self.segment_host.alive():
            self.segment_host.terminate(timeout_s=10)
        if self._master is not None and self._master.poll() is None:
            self._master.terminate()
            try:
                self._master.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._master.kill()
                self._master.wait(timeout=10)


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False

