"""Fleet: one etcd, services and many simulated engines on this machine, for
benchmarks/bench_fleet.py and the fleet integration test.

Stages: start etcd (fixed ports and data dir, so it can restart in place) -> services ->
engine hosts (`xllm_py.sim.host`, up to `per_host` engines a process; engine i of a role
is `<role>-<i>`) -> wait until the master sees every engine ACTIVE -> events: kill the
master, restart etcd (data kept or lost), kill and restart every engine host -> stop.
"""
from __future__ import annotations

import asyncio
import dataclasses
import pathlib
import re
import tempfile
import time

import httpx

from xllm_py.cluster.etcd_client import MASTER_KEY, EtcdClient
from xllm_py.cluster.etcd_server import EmbeddedEtcd
from xllm_py.utils.config_file import write_settings
from xllm_py.utils.procs import ChildProcess, free_port, spawn


@dataclasses.dataclass
class EngineGroup:
    role: str
    first: int
    count: int
    proc: ChildProcess


class Fleet:
    def __init__(self, profile: str, model_dir: str, log_dir: pathlib.Path, *,
                 namespace: str = "fleet/", ttl_s: float = 3.0, heartbeat_s: float = 0.5,
                 per_host: int = 16, service_module: str = "xllm_service",
                 service_args: list[str] | None = None,  # "{name}": the service's name
                 engine_args: list[str] | None = None,
                 log_level: str = "WARNING") -> None:
        self.profile, self.model_dir, self.log_dir = profile, model_dir, log_dir
        self.namespace, self.ttl_s, self.heartbeat_s = namespace, ttl_s, heartbeat_s
        self.per_host = per_host
        self.service_module = service_module
        self.service_args = list(service_args or [])
        self.engine_args = list(engine_args or [])
        self.log_level = log_level
        self._data_dir = tempfile.mkdtemp(prefix="xllm-fleet-etcd-")
        self.etcd = EmbeddedEtcd(data_dir=self._data_dir, client_port=free_port(),
                                 peer_port=free_port())
        self.services: list[ChildProcess] = []
        self.groups: list[EngineGroup] = []
        self._num_services = 0

    # ------------------------------------------------------------------ start / stop
    def start(self, num_services: int = 2) -> None:
        self.etcd.start()
        for _ in range(num_services):
            self.add_service()

    def add_service(self) -> ChildProcess:
        http, rpc = free_port(), free_port()
        name = f"service-{self._num_services}"
        self._num_services += 1
        proc = spawn(name, self.service_module,
                     ["--etcd", self.etcd.endpoint, "--etcd-namespace", self.namespace,
                      "--etcd-ttl", str(self.ttl_s), "--http-port", str(http),
                      "--rpc-port", str(rpc), "--model", self.model_dir,
                      "--log-level", self.log_level,
                      *(a.format(name=name) for a in self.service_args)],
                     self.log_dir, http_url=f"http://127.0.0.1:{http}")
        self.services.append(proc)
        return proc

    def add_engines(self, role: str, count: int) -> None:
        """`count` more engines of `role`, named after those already there."""
        first = sum(g.count for g in self.groups if g.role == role)
        for start in range(first, first + count, self.per_host):
            n = min(self.per_host, first + count - start)
            self.groups.append(EngineGroup(role, start, n, self._spawn_host(role, start, n)))

    def _spawn_host(self, role: str, first: int, count: int) -> ChildProcess:
        name = f"{role.lower()}-{first}-{first + count - 1}"
        ports = ",".join(str(free_port()) for _ in range(count))  # (unique in this process)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        settings = write_settings(self.log_dir / "engine-settings.yaml", {
            "etcd_ttl": self.ttl_s, "heart_beat_interval": self.heartbeat_s})
        args = ["--count", str(count), "--name-prefix", role.lower(), "--first-index",
                str(first), "--ports", ports, "--simulate", self.profile, "--model", self.model_dir,
                "--instance-role", role, "--etcd", self.etcd.endpoint,
                "--etcd-namespace", self.namespace, *settings, "--log-level", self.log_level,
                *self.engine_args]
        return spawn(name, "xllm_py.sim.host", args, self.log_dir)

    @property
    def num_engines(self) -> int:
        return sum(g.count for g in self.groups)

    def kill_engines(self) -> None:
        for g in self.groups:
            g.proc.kill()

    def restart_engines(self) -> None:
        """Start every engine host again (same names, new ports), after kill_engines."""
        for g in self.groups:
            g.proc.kill()
            g.proc = self._spawn_host(g.role, g.first, g.count)

    def stop(self) -> None:
        for g in self.groups:
            g.proc.terminate(timeout_s=15)
        for s in self.services:
            s.terminate()
        self.etcd.stop(remove_data=False)
        import shutil

        shutil.rmtree(self._data_dir, ignore_errors=True)

    # ------------------------------------------------------------------ observing
    def alive_services(self) -> list[ChildProcess]:
        return [s for s in self.services if s.alive()]

    async def master(self) -> ChildProcess | None:
        """The service process whose rpc address is the master key's value."""
        try:
            async with EtcdClient(self.etcd.endpoint, namespace=self.namespace) as etcd:
                kv = await etcd.get(MASTER_KEY)
        except Exception:
            return None
        if kv is None:
            return None
        port = kv.value.decode().rsplit(":", 1)[1]
        return next((s for s in self.alive_services()
                     if s.argv[s.argv.index("--rpc-port") + 1] == port), None)

    def active(self, service: ChildProcess) -> int:
        """Engines `service` sees ACTIVE (-1: it does not answer)."""
        try:
            text = httpx.get(service.http_url + "/metrics", timeout=2,
                             trust_env=False).text
        except httpx.HTTPError:
            return -1
        m = re.search(r'^xllm_service_instances\{state="ACTIVE"\} ([0-9.e+]+)$', text, re.M)
        return int(float(m.group(1))) if m else 0

    async def incarnations(self) -> dict[str, str]:
        """Engine name -> the incarnation id registered in etcd now."""
        from xllm_py.cluster.etcd_client import parse_instance_key
        from xllm_py.cluster.instance_meta import InstanceMeta

        try:
            async with EtcdClient(self.etcd.endpoint, namespace=self.namespace) as etcd:
                kvs, _ = await etcd.get_prefix("XLLM:")
        except Exception:
            return {}
        metas = [InstanceMeta.from_json(kv.value) for kv in kvs
                 if parse_instance_key(kv.key) is not None]
        return {m.name: m.incarnation_id for m in metas}

    async def wait_all_active(self, timeout_s: float, step_s: float = 0.1,
                              since: float | None = None,
                              replacing: dict[str, str] | None = None) -> tuple[float, int]:
        """Seconds (from `since`, monotonic; default now) until a master sees every engine
        ACTIVE, each in an incarnation other than the one `replacing` names (engines
        restarted: the old keys stay until their leases expire), and the fewest ACTIVE
        seen on the way. Raises TimeoutError."""
        t0, lowest = time.monotonic(), self.num_engines
        since = t0 if since is None else since
        while True:
            master = await self.master()
            n = self.active(master) if master is not None else 0
            if replacing and n > 0:
                now = await self.incarnations()
                n = min(n, sum(1 for k, v in now.items() if replacing.get(k) not in (None, v)))
            lowest = min(lowest, max(n, 0))
            if n == self.num_engines:
                return time.monotonic() - since, lowest
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"{n} of {self.num_engines} engines ACTIVE after "
                                   f"{timeout_s:.0f}s (master: {master and master.name})")
            for g in self.groups:
                if not g.proc.alive():
                    raise RuntimeError(f"engine host {g.proc.name} exited:\n"
                                       f"{g.proc.log_tail()}")
            await asyncio.sleep(step_s)
