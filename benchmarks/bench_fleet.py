"""The master under a fleet of simulated engines (xllm_py/sim): how the service scales
with the number of instances, and how the fleet gets through failures.

Stages: a time-model profile (--profile, or measured here from the real tiny engine) ->
per fleet (MIX and PD, 1..128 instances): one etcd, 2 services, the engines (16 a
process) -> every engine ACTIVE -> the master's idle CPU -> a closed-loop streaming load
through the master (bench_serving's client): requests/s, master CPU per request, routing
decision time (Router.route, timed inside the service: benchmarks/fleet_service.py),
TTFT, TPOT -> on the --events fleet, under load through both services: kill the master,
restart etcd (data kept; data lost), kill and restart every engine; each: seconds until
the master sees every engine ACTIVE again, the fewest ACTIVE on the way, requests lost.

    python benchmarks/bench_fleet.py --json bench_out/fleet.json
    python benchmarks/bench_fleet.py --fleets MIX:8,PD:8 --events PD:8 --requests 100
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import platform
import random
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_serving import BenchRequest, percentile, send_request  # noqa: E402
from benchmarks.common import process_cpu_seconds  # noqa: E402
from xllm_py.sim.engine import sim_model_dir  # noqa: E402
from xllm_py.sim.fleet import Fleet  # noqa: E402
from xllm_py.sim.profile import cpu_model  # noqa: E402

DEFAULT_FLEETS = "MIX:1,MIX:8,PD:8,MIX:64,PD:64,MIX:128,PD:128"


def machine() -> dict[str, Any]:
    mem = next((ln.split()[1] for ln in open("/proc/meminfo") if ln.startswith("MemTotal")), "0")
    return {"python": platform.python_version(), "cpu": cpu_model(), "cores": os.cpu_count(),
            "memory_gb": round(int(mem) / 1e6, 1), "load_avg_at_start": os.getloadavg(),
            "platform": platform.platform()}


def rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS")) / 1024
    except (OSError, StopIteration):
        return float("nan")


def route_times_us(path: pathlib.Path) -> list[float]:
    try:
        return [ns / 1000 for ns in json.loads(path.read_text())]
    except (OSError, ValueError):
        return []


class Load:
    """`concurrency` clients, each sending one streaming request after another (to the
    alive services in turn) until stopped; every result kept with its send time."""

    def __init__(self, fleet: Fleet, model: str, args: argparse.Namespace,
                 only_master: Any = None) -> None:
        self.fleet, self.model, self.args, self.only = fleet, model, args, only_master
        self.results: list = []
        self._stop = asyncio.Event()
        self._rng = random.Random(0)
        self._n = 0

    def _request(self) -> BenchRequest:
        self._n += 1
        prompt = [self._rng.randrange(16, 1000) for _ in range(self.args.input_len)]
        return BenchRequest(self._n, prompt, self.args.input_len, self.args.output_len)

    async def _client(self, http: httpx.AsyncClient, limit: int | None) -> None:
        while not self._stop.is_set() and (limit is None or self._n < limit):
            services = [self.only] if self.only else self.fleet.alive_services()
            svc = services[self._n % len(services)]
            res = await send_request(http, svc.http_url + "/v1", self.model, self._request())
            res.ok = res.ok and res.output_len == self.args.output_len
            self.results.append((svc.name, res))

    async def run(self, limit: int | None = None) -> float:
        t0 = time.perf_counter()
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(120, connect=10),
                                     trust_env=False) as http:
            await asyncio.gather(*(self._client(http, limit)
                                   for _ in range(self.args.concurrency)))
        return time.perf_counter() - t0

    def stop(self) -> None:
        self._stop.set()


def _fleet(spec: str, args: argparse.Namespace, profile: str, model_dir: str,
           log_dir: pathlib.Path) -> Fleet:
    kind, n = spec.split(":")
    fleet = Fleet(profile, model_dir, log_dir / spec.replace(":", "-"),
                  service_module="benchmarks.fleet_service",
                  service_args=["--route-times", str(log_dir / f"{spec.replace(':', '-')}"
                                                     "-{name}-route.json")],
                  per_host=args.per_host, ttl_s=args.etcd_ttl)
    fleet.start(num_services=2)
    if kind == "MIX":
        fleet.add_engines("MIX", int(n))
    else:
        fleet.add_engines("PREFILL", int(n) // 2)
        fleet.add_engines("DECODE", int(n) - int(n) // 2)
    return fleet


async def measure_fleet(fleet: Fleet, spec: str, args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.monotonic()
    await fleet.wait_all_active(args.start_timeout)
    start_s = time.monotonic() - t0
    master = await fleet.master()
    route_file = pathlib.Path(master.argv[master.argv.index("--route-times") + 1])
    await Load(fleet, "tiny", args, master).run(limit=args.concurrency)  # warm-up
    cpu0, t_idle = process_cpu_seconds(master.pid), time.monotonic()
    await asyncio.sleep(args.idle_s)
    idle_cpu = (process_cpu_seconds(master.pid) - cpu0) / (time.monotonic() - t_idle)
    await asyncio.sleep(0.6)  # (the route-times file is written twice a second)
    n_routes0 = len(route_times_us(route_file))
    load = Load(fleet, "tiny", args, master)
    cpu0 = process_cpu_seconds(master.pid)
    wall = await load.run(limit=args.requests)
    cpu = process_cpu_seconds(master.pid) - cpu0
    await asyncio.sleep(0.6)
    routes = route_times_us(route_file)[n_routes0:]
    ok = [r for _, r in load.results if r.ok]
    hosts = [g.proc.pid for g in fleet.groups]
    return {
        "fleet": spec, "instances": fleet.num_engines, "start_s": start_s,
        "requests": len(load.results), "failed": len(load.results) - len(ok),
        "req_per_s": len(ok) / wall, "master_cpu_ms_per_req": cpu * 1000 / max(1, len(ok)),
        # the same less what the master spends idle (heartbeats, registry) meanwhile
        "master_net_cpu_ms_per_req": (cpu - idle_cpu * wall) * 1000 / max(1, len(ok)),
        "master_idle_cpu_pct": idle_cpu * 100,
        "route_us": {"n": len(routes), "p50": percentile(routes, 50),
                     "p99": percentile(routes, 99)},
        "ttft_ms": {q: percentile([r.ttft * 1000 for r in ok], q) for q in (50, 99)},
        "tpot_ms": {q: percentile([r.tpot * 1000 for r in ok if r.tpot], q) for q in (50, 99)},
        "rss_mb_per_engine": sum(rss_mb(p) for p in hosts) / fleet.num_engines,
        "master_rss_mb": rss_mb(master.pid),
    }


async def run_event(fleet: Fleet, name: str, args: argparse.Namespace) -> dict[str, Any]:
    """`name` under load through both services: recovery time, fewest ACTIVE, lost."""
    load = Load(fleet, "tiny", args)
    task = asyncio.create_task(load.run())
    await asyncio.sleep(args.event_lead_s)
    old_master = await fleet.master()
    before = await fleet.incarnations() if name == "engines restarted" else None
    t0 = time.monotonic()
    takeover = etcd_up = None
    if name == "master killed":
        old_master.kill()
        while (m := await fleet.master()) is None or m is old_master:
            await asyncio.sleep(0.05)
        takeover = time.monotonic() - t0
    elif name.startswith("etcd restart"):
        fleet.etcd.kill()
        if "lost" in name:
            import shutil

            shutil.rmtree(fleet.etcd._data_dir, ignore_errors=True)  # (its own temp dir)
        fleet.etcd.start()
        etcd_up = time.monotonic() - t0
    elif name == "engines restarted":
        fleet.kill_engines()
        fleet.restart_engines()
    await asyncio.sleep(0.2)  # (let the master notice before polling its view)
    recovered, lowest = await fleet.wait_all_active(args.start_timeout, since=t0,
                                                    replacing=before)
    await asyncio.sleep(args.event_tail_s)
    load.stop()
    await task
    during = load.results
    lost = [r for _, r in during if not r.ok]
    by_service: dict[str, int] = {}
    for svc, r in during:
        if not r.ok:
            by_service[svc] = by_service.get(svc, 0) + 1
    if name == "master killed":
        fleet.add_service().wait_ready(60, path="/readiness")  # two again, for the next
    return {"event": name, "fleet": f"{fleet.num_engines} instances",
            "takeover_s": takeover, "etcd_up_s": etcd_up, "all_active_s": recovered,
            "lowest_active": lowest, "requests": len(during), "lost": len(lost),
            "lost_by_service": by_service, "killed_master": old_master.name,
            "errors": sorted({r.error[:120] for r in lost})[:4]}


def route_micro(sizes: list[int], calls: int = 2000) -> list[dict[str, Any]]:
    """CPU time (thread time) of Router.route over an instance table of n instances, in
    this process: the routing decision's own cost, without the scheduling delays of a
    loaded machine that the in-service timing includes."""
    from xllm_py.cluster.instance_meta import InstanceMeta
    from xllm_py.config import InstanceRole
    from xllm_service.instance_table import InstanceTable
    from xllm_service.router import Router, make_policy

    out = []
    for kind in ("MIX", "PD"):
        for n in sizes:
            if kind == "PD" and n < 2:
                continue
            table = InstanceTable()
            for i in range(n):
                role = (InstanceRole.MIX if kind == "MIX" else
                        (InstanceRole.PREFILL, InstanceRole.DECODE)[i % 2])
                table.key_put(InstanceMeta(name=f"i{i}", type=role, incarnation_id="x"), 0.0)
            router = Router(table.schedulable, make_policy("LEAST_LOAD", lambda name: 0))
            times = []
            for _ in range(calls):
                t0 = time.thread_time_ns()
                router.route(None)
                times.append((time.thread_time_ns() - t0) / 1000)
            out.append({"fleet": f"{kind}:{n}", "route_cpu_us_p50": percentile(times, 50),
                        "route_cpu_us_p99": percentile(times, 99)})
    return out


def _table(rows: list[dict[str, Any]], events: list[dict[str, Any]]) -> str:
    out = ["| fleet | instances | start s | req/s | master CPU ms/req (net of idle) | "
           "master idle CPU % | route p50 us | route p99 us | TTFT p50/p99 ms | "
           "TPOT p50/p99 ms | failed | RSS MB/engine |", "|" + "---|" * 12]
    for r in rows:
        out.append(f"| {r['fleet']} | {r['instances']} | {r['start_s']:.1f} | "
                   f"{r['req_per_s']:.1f} | {r['master_cpu_ms_per_req']:.2f} "
                   f"({r['master_net_cpu_ms_per_req']:.2f}) | "
                   f"{r['master_idle_cpu_pct']:.1f} | {r['route_us']['p50']:.0f} | "
                   f"{r['route_us']['p99']:.0f} | {r['ttft_ms'][50]:.0f}/{r['ttft_ms'][99]:.0f}"
                   f" | {r['tpot_ms'][50]:.1f}/{r['tpot_ms'][99]:.1f} | "
                   f"{r['failed']}/{r['requests']} | {r['rss_mb_per_engine']:.0f} |")
    if events:
        out += ["", "| event | fleet | master takeover s | etcd up s | all ACTIVE again s | "
                "fewest ACTIVE | requests lost |", "|" + "---|" * 7]
        for e in events:
            take, up = (("-" if v is None else f"{v:.1f}")
                        for v in (e["takeover_s"], e["etcd_up_s"]))
            out.append(f"| {e['event']} | {e['fleet']} | {take} | {up} | "
                       f"{e['all_active_s']:.1f} | {e['lowest_active']} | "
                       f"{e['lost']}/{e['requests']} |")
        for e in events:
            if e["errors"]:
                out.append(f"{e['event']}: lost by service {e['lost_by_service']} "
                           f"(master was {e['killed_master']}): {e['errors']}")
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", default=None,
                   help="time-model JSON (default: measure the tiny engine now)")
    p.add_argument("--fleets", default=DEFAULT_FLEETS, help="KIND:INSTANCES,...")
    p.add_argument("--events", default="PD:128", help="fleet for the failure events ('' none)")
    p.add_argument("--requests", type=int, default=300, help="requests per fleet")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--per-host", type=int, default=16, help="simulated engines per process")
    p.add_argument("--etcd-ttl", type=float, default=3.0)
    p.add_argument("--idle-s", type=float, default=3.0, help="idle CPU sample")
    p.add_argument("--event-lead-s", type=float, default=2.0)
    p.add_argument("--event-tail-s", type=float, default=2.0)
    p.add_argument("--start-timeout", type=float, default=180.0)
    p.add_argument("--log-dir", default=None)
    p.add_argument("--json", default=None)
    return p


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    log_dir = pathlib.Path(args.log_dir or tempfile.mkdtemp(prefix="bench-fleet-"))
    profile = args.profile or str(log_dir / "profile.json")
    if not args.profile:
        subprocess.run([sys.executable, "-m", "xllm_py.sim.profile", "--out", profile,
                        "--model", "tiny", "--num-threads", "1"], check=True)
    model_dir = sim_model_dir("tiny")
    result: dict[str, Any] = {"machine": machine(), "profile": json.loads(
        pathlib.Path(profile).read_text()), "args": vars(args), "fleets": [], "events": [],
        "route_micro": route_micro([1, 8, 64, 128, 256])}
    for r in result["route_micro"]:
        print(json.dumps(r), flush=True)
    specs = [s for s in args.fleets.split(",") if s]
    if args.events and args.events not in specs:
        specs.append(args.events)
    for spec in specs:
        fleet = _fleet(spec, args, profile, model_dir, log_dir)
        try:
            if spec in args.fleets.split(","):
                row = await measure_fleet(fleet, spec, args)
                result["fleets"].append(row)
                print(json.dumps(row), flush=True)
            else:
                await fleet.wait_all_active(args.start_timeout)
            if spec == args.events:
                for event in ("master killed", "etcd restart (data kept)",
                              "etcd restart (data lost)", "engines restarted"):
                    ev = await run_event(fleet, event, args)
                    result["events"].append(ev)
                    print(json.dumps(ev), flush=True)
        finally:
            fleet.stop()
    return result


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = asyncio.run(amain(args))
    m = result["machine"]
    print(f"\npython {m['python']}, {m['cpu']}, {m['cores']} cores, {m['memory_gb']} GB, "
          f"load average at start {m['load_avg_at_start'][0]:.1f}")
    print(_table(result["fleets"], result["events"]))
    print("\nRouter.route CPU us p50/p99 (in-process table): " + ", ".join(
        f"{r['fleet']} {r['route_cpu_us_p50']:.0f}/{r['route_cpu_us_p99']:.0f}"
        for r in result["route_micro"]))
    if args.json:
        pathlib.Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
