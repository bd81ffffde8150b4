"""Hosts of our own on this machine: network namespaces joined by bridges, with links that
can be cut or slowed (../shared/reference/NETWORK.md). The fault tests
(tests/integration/test_netns_faults.py) and the throttled KV hand-over bench
(kv_stream_handover.py --rate-mbit) build their hosts with it.

Topology (one per test module, names unique to this run so leftovers cannot collide):

    subnet A (bridge xb<id>a)          subnet B (bridge xb<id>b)
      ctl   10.N.1.1 ---- router ---- 10.N.2.1   ctl: etcd + service, forwarding on
      p0    10.N.1.2                   d0 10.N.2.2, d1 10.N.2.3 ...
      (this machine 10.N.1.254)        (this machine 10.N.2.254)

`ctl` is the router: with forwarding off (`partition()`) A and B are cut apart while every
host still reaches ctl (etcd, the service) and this machine reaches everyone (the tests'
clients, /metrics). `down(host)` takes a host's link away, `slow(host, rate)` puts a token
bucket on its egress (this kernel has no netem). Only our namespaces and addresses are
ever sent to. `close()` removes everything and is safe to call twice or after a failure.
Beside a Docker daemon (FORWARD policy DROP, bridged frames filtered) the lab accepts
frames between its own bridges' ports in DOCKER-USER (or FORWARD), rules `close()` deletes.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid

from xllm_py.config import child_env
from xllm_py.utils.procs import ChildProcess, guarded


def unavailable_reason() -> str | None:
    """Why the lab cannot be built here (None: it can)."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "the 'ip' and 'tc' tools (iproute2) are not installed"
    probe = f"xp{uuid.uuid4().hex[:6]}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"'ip netns add' failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {r.stderr.strip() or r.stdout.strip()}")
    return r


def _used_subnets() -> set[int]:
    out = _run("ip", "-o", "-4", "addr", "show").stdout
    used = set()
    for line in out.splitlines():
        parts = line.split()
        addr = parts[parts.index("inet") + 1] if "inet" in parts else ""
        if addr.startswith("10."):
            used.add(int(addr.split(".")[1]))
    return used


def forward_filter_chain() -> str | None:
    """The iptables chain where frames crossing the lab's bridges must be accepted (None: none).

    With br_netfilter loaded (dockerd loads it) bridged frames go through this machine's
    FORWARD chain, and dockerd sets its policy to DROP: every frame between two lab hosts
    would be dropped. Docker's DOCKER-USER chain is evaluated first and left alone by it.
    """
    if shutil.which("iptables") is None:
        return None
    r = subprocess.run(["iptables", "-w", "5", "-S", "FORWARD"], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        return None
    if "-j DOCKER-USER" in r.stdout:
        return "DOCKER-USER"
    return "FORWARD" if "-P FORWARD DROP" in r.stdout else None


class NetLab:
    def __init__(self) -> None:
        self.id = uuid.uuid4().hex[:5]
        used = _used_subnets()
        free = [n for n in range(200, 250) if n not in used]
        if not free:
            raise RuntimeError("no free 10.N.0.0/16 for the lab")
        self.net = free[int(self.id, 16) % len(free)]
        self.namespaces: list[str] = []
        self.filter_chain = forward_filter_chain()
        self.rules: list[list[str]] = []  # iptables rule specs we added (deleted by close())
        self.links: list[str] = []  # links on this machine (bridges, veth ends)
        self.hosts: dict[str, str] = {}  # host -> its address
        self._next = {"a": 2, "b": 2}
        self._num_veths = 0
        try:
            self._bridge("a")
            self._bridge("b")
            ctl = self._namespace("ctl")
            self._leg(ctl, "a", 1, "eth0")
            self._leg(ctl, "b", 1, "eth1")
            _run("ip", "netns", "exec", ctl, "sysctl", "-qw", "net.ipv4.ip_forward=1")
            self.hosts["ctl"] = self.addr("a", 1)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ wiring
    def addr(self, subnet: str, n: int) -> str:
        return f"10.{self.net}.{1 if subnet == 'a' else 2}.{n}"

    def ns(self, host: str) -> str:
        return f"xl{self.id}-{host}"

    def _bridge(self, subnet: str) -> None:
        br = f"xb{self.id}{subnet}"
        _run("ip", "link", "add", br, "type", "bridge")
        self.links.append(br)
        _run("ip", "addr", "add", f"{self.addr(subnet, 254)}/24", "dev", br)
        _run("ip", "link", "set", br, "up")
        if self.filter_chain:  # let frames between the bridge's own ports through
            rule = [self.filter_chain, "-i", br, "-o", br, "-j", "ACCEPT"]
            _run("iptables", "-w", "5", "-I", *rule)
            self.rules.append(rule)

    def _namespace(self, host: str) -> str:
        ns = self.ns(host)
        _run("ip", "netns", "add", ns)
        self.namespaces.append(ns)
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        return ns

    def _leg(self, ns: str, subnet: str, n: int, dev: str) -> None:
        self._num_veths += 1
        outside = f"xv{self.id}{self._num_veths}"
        _run("ip", "link", "add", outside, "type", "veth", "peer", "name", dev, "netns", ns)
        self.links.append(outside)
        _run("ip", "link", "set", outside, "master", f"xb{self.id}{subnet}", "up")
        _run("ip", "-n", ns, "addr", "add", f"{self.addr(subnet, n)}/24", "dev", dev)
        _run("ip", "-n", ns, "link", "set", dev, "up")

    def add_host(self, host: str, subnet: str) -> str:
        """A namespace host on subnet `subnet` ("a" or "b"), routed through ctl; its address."""
        n = self._next[subnet]
        self._next[subnet] += 1
        ns = self._namespace(host)
        self._leg(ns, subnet, n, "eth0")
        _run("ip", "-n", ns, "route", "add", "default", "via", self.addr(subnet, 1))
        self.hosts[host] = self.addr(subnet, n)
        return self.hosts[host]

    # ------------------------------------------------------------------ faults
    def down(self, host: str) -> None:
        _run("ip", "-n", self.ns(host), "link", "set", "eth0", "down")

    def up(self, host: str) -> None:
        ns = self.ns(host)
        _run("ip", "-n", ns, "link", "set", "eth0", "up")
        subnet = "a" if self.hosts[host].split(".")[2] == "1" else "b"
        # the default route went with the link
        _run("ip", "-n", ns, "route", "replace", "default", "via", self.addr(subnet, 1))

    def slow(self, host: str, rate: str = "4mbit", burst: str = "16kb",
             dev: str = "eth0") -> None:
        """A token bucket on the host's egress (what it sends: a prefill's KV, pushed or
        pulled; ``dev`` "eth1" of ctl: whatever it forwards into subnet B). A fast rate
        needs a bigger ``burst`` to reach it (the bucket refills once per wake-up)."""
        _run("ip", "netns", "exec", self.ns(host), "tc", "qdisc", "replace", "dev", dev,
             "root", "tbf", "rate", rate, "burst", burst, "latency", "400ms")

    def unslow(self, host: str, dev: str = "eth0") -> None:
        _run("ip", "netns", "exec", self.ns(host), "tc", "qdisc", "del", "dev", dev, "root",
             check=False)

    def partition(self, on: bool = True) -> None:
        """Subnets A and B cut apart (ctl stops forwarding); both still reach ctl."""
        _run("ip", "netns", "exec", self.ns("ctl"), "sysctl", "-qw",
             f"net.ipv4.ip_forward={0 if on else 1}")

    # ------------------------------------------------------------------ processes
    def spawn(self, host: str, name: str, module: str, args: list[str], log_dir,
              http_url: str | None = None, env: dict[str, str] | None = None) -> ChildProcess:
        """python -m <module> <args> on `host`, output to <log_dir>/<name>.log."""
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"{name}.log"
        argv = [sys.executable, "-m", module, *args]
        full_env = child_env(PYTHONUNBUFFERED="1", NO_PROXY="*", **(env or {}))
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(["ip", "netns", "exec", self.ns(host), *guarded(argv)],
                                     stdout=log, stderr=subprocess.STDOUT, env=full_env,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        return ChildProcess(name, argv, log_path, popen, http_url)

    def close(self) -> None:
        for ns in reversed(self.namespaces):
            _run("ip", "netns", "del", ns, check=False)
        self.namespaces.clear()
        for link in reversed(self.links):
            _run("ip", "link", "del", link, check=False)  # (a veth end goes with its ns)
        self.links.clear()
        for rule in reversed(self.rules):
            _run("iptables", "-w", "5", "-D", *rule, check=False)
        self.rules.clear()

    def leftovers(self) -> list[str]:
        """Our namespaces and links still present (empty after close())."""
        out = _run("ip", "netns", "list").stdout + _run("ip", "-o", "link").stdout
        found = {w.split("@")[0].rstrip(":") for w in out.split()
                 if w.startswith((f"xl{self.id}", f"xb{self.id}", f"xv{self.id}"))}
        if self.filter_chain:
            rules = _run("iptables", "-w", "5", "-S", self.filter_chain, check=False).stdout
            found |= {f"iptables: {ln}" for ln in rules.splitlines() if f"xb{self.id}" in ln}
        return sorted(found)
