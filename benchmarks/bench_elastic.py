"""Elastic prefill/decode on a simulated fleet: fixed splits against the master's elastic
roles, under a load that shifts from prefill-heavy to decode-heavy and back.

Stages: a time-model profile (--profile, or measured here from the default model) -> one
fleet (xllm_py/sim/fleet.py): etcd, a service with `--elastic-pd on`, N simulated
engines started MIX -> per arm, in interleaved order: the split set in etcd (a fixed
split: every instance pinned; elastic: unpinned, starting from half and half, the master
moves them) -> the three-phase trace, open loop (Poisson arrivals): long prompts with
short answers, short prompts with long answers, long prompts again; each phase's rate
set from the profile so that about 3/4 of the fleet is needed on the phase's heavy side
-> per phase and overall: goodput (requests meeting the TTFT and TPOT targets the
service states, per second), SLO attainment, failures; for elastic the flips and how long
after a phase change the split stopped moving.

    python benchmarks/bench_elastic.py [--profile PROFILE.json] [--phase-s 180] [--json out.json]

Every arm runs on the same engines (elastic ones pinned for the fixed splits: the same
code, settings and pools), one after another on one machine, a demand window apart (the
elastic arm does not start from the last arm's load). A phase's requests all end before
the next phase starts. The master decides with its default settings unless `--hold-s` or
`--min-dwell-s` say otherwise.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import pathlib
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

from benchmarks.serving_client import send_request  # noqa: E402
from benchmarks.serving_workload import BenchRequest  # noqa: E402
from xllm_py.cluster import slo_defaults  # noqa: E402
from xllm_py.cluster.etcd_client import EtcdClient  # noqa: E402
from xllm_py.cluster.latency_profile import LatencyProfile  # noqa: E402
from xllm_py.cluster.role_assignment import ROLE_PREFIX, RoleAssignment, role_key  # noqa: E402
from xllm_py.config import InstanceRole  # noqa: E402
from xllm_py.sim.engine import sim_model_dir  # noqa: E402
from xllm_py.sim.fleet import Fleet  # noqa: E402
from xllm_py.utils.config_file import write_settings  # noqa: E402
from xllm_service.config import ElasticConfig  # noqa: E402

P, D = InstanceRole.PREFILL, InstanceRole.DECODE


@dataclasses.dataclass(frozen=True)
class Phase:
    name: str
    prompt_len: int
    output_len: int
    rate: float  # requests per second


def phases(p: LatencyProfile, n: int, ttft_ms: float, tpot_ms: float,
           args: argparse.Namespace) -> list[Phase]:
    """The trace: each phase's rate needs `args.heavy_share` of the `n` instances on its
    heavy side (prefills: one prompt at a time each; decodes: as many streams as keep a
    step within the TPOT target)."""
    heavy = args.heavy_share * n
    prefill_rate = heavy * 1000 / p.prefill_ms(args.long_prompt)
    ctx = args.short_prompt + args.long_output / 2
    streams = 1
    while p.decode_step_ms(streams + 1, (streams + 1) * ctx) <= tpot_ms and streams < 256:
        streams += 1
    decode_rate = heavy * streams * 1000 / (tpot_ms * args.long_output)
    a = Phase("prefill-heavy", args.long_prompt, args.short_output, prefill_rate)
    b = Phase("decode-heavy", args.short_prompt, args.long_output, decode_rate)
    return [a, b, dataclasses.replace(a, name="prefill-heavy again")]


async def set_split(fleet: Fleet, names: list[str], prefills: int, pinned: bool) -> None:
    """The first `prefills` instances PREFILL, the rest DECODE, each one epoch up; waits
    until every instance acknowledged it."""
    async with EtcdClient(fleet.etcd.endpoint, namespace=fleet.namespace) as etcd:
        kvs, _ = await etcd.get_prefix(ROLE_PREFIX)
        epochs = {kv.key.removeprefix(ROLE_PREFIX): RoleAssignment.from_json(kv.value).epoch
                  for kv in kvs}
        for i, name in enumerate(names):
            role = P if i < prefills else D
            await etcd.put(role_key(name), RoleAssignment(
                role, epochs.get(name, 0) + 1, pinned=pinned).to_json())
        deadline = time.monotonic() + 60
        while (await acked(etcd)) != {n: (P if i < prefills else D)
                                      for i, n in enumerate(names)}:
            if time.monotonic() > deadline:
                raise TimeoutError("the split was not acknowledged within 60 s")
            await asyncio.sleep(0.2)


async def acked(etcd: EtcdClient) -> dict[str, InstanceRole]:
    kvs, _ = await etcd.get_prefix("XLLM:MIX:")
    out = {}
    for kv in kvs:
        meta = json.loads(kv.value)
        if meta.get("duty"):
            out[meta["name"]] = InstanceRole(meta["duty"])
    return out


async def run_phase(url: str, phase: Phase, seconds: float, rng: random.Random,
                    max_inflight: int) -> list:
    """Open loop: Poisson arrivals at the phase's rate for `seconds`; every result."""
    results: list = []
    tasks: set[asyncio.Task] = set()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600, connect=10),
                                 trust_env=False) as http:
        t_end = time.monotonic() + seconds
        n = 0
        while True:
            await asyncio.sleep(rng.expovariate(phase.rate))
            if time.monotonic() >= t_end:
                break
            if len(tasks) >= max_inflight:  # (the client's own limit: counted as a miss)
                results.append(None)
                continue
            n += 1
            prompt = [rng.randrange(16, 1000) for _ in range(phase.prompt_len)]
            req = BenchRequest(n, prompt, phase.prompt_len, phase.output_len)
            task = asyncio.create_task(send_request(http, url + "/v1", "tiny", req))
            task.add_done_callback(lambda t: results.append(t.result()))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(tasks)
    return results


def score(results: list, seconds: float, ttft_ms: float, tpot_ms: float) -> dict[str, Any]:
    done = [r for r in results if r is not None and r.ok]
    good = [r for r in done if r.ttft * 1000 <= ttft_ms
            and (r.tpot is None or r.tpot * 1000 <= tpot_ms)]
    return {"requests": len(results), "failed": len(results) - len(done),
            "good": len(good), "goodput": len(good) / seconds,
            "attainment": len(good) / max(1, len(results))}


async def watch_split(fleet: Fleet, stop: asyncio.Event, timeline: list) -> None:
    async with EtcdClient(fleet.etcd.endpoint, namespace=fleet.namespace) as etcd:
        while not stop.is_set():
            roles = await acked(etcd)
            split = (sum(r is P for r in roles.values()), sum(r is D for r in roles.values()))
            if not timeline or timeline[-1][1] != split:
                timeline.append((time.monotonic(), split))
            await asyncio.sleep(0.5)


async def run_arm(fleet: Fleet, names: list[str], arm: str, trace: list[Phase],
                  args: argparse.Namespace, targets: tuple[float, float]) -> dict[str, Any]:
    elastic = arm == "elastic"
    prefills = len(names) // 2 if elastic else int(arm.split("P")[0])
    await set_split(fleet, names, prefills, pinned=not elastic)
    url = fleet.services[0].http_url
    timeline: list = []
    stop = asyncio.Event()
    watcher = asyncio.create_task(watch_split(fleet, stop, timeline))
    rng = random.Random(1)
    rows, all_results, starts = [], [], []
    for phase in trace:
        starts.append(time.monotonic())
        results = await run_phase(url, phase, args.phase_s, rng, args.max_inflight)
        all_results += results
        rows.append({"phase": phase.name, **score(results, args.phase_s, *targets)})
    stop.set()
    await watcher
    row: dict[str, Any] = {"arm": arm, "phases": rows,
                           "overall": score(all_results, args.phase_s * len(trace), *targets)}
    if elastic:
        row["splits"] = [(round(t - starts[0], 1), s) for t, s in timeline]
        row["flips"] = max(0, len(timeline) - 1)
        row["settled_s"] = [round(max([t for t, _ in timeline if s0 <= t < s0 + args.phase_s],
                                      default=s0) - s0, 1) for s0 in starts]
    return row


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", default=None,
                   help="time-model JSON (default: measure the default model now)")
    p.add_argument("--instances", type=int, default=16)
    p.add_argument("--arms", default="4P12D,8P8D,12P4D,elastic")
    p.add_argument("--phase-s", type=float, default=180.0,
                   help="seconds of each phase (a phase's requests then finish)")
    p.add_argument("--heavy-share", type=float, default=0.7,
                   help="of the instances, the share a phase's heavy side needs")
    p.add_argument("--long-prompt", type=int, default=1024)
    p.add_argument("--short-prompt", type=int, default=64)
    p.add_argument("--long-output", type=int, default=128)
    p.add_argument("--short-output", type=int, default=4)
    p.add_argument("--max-inflight", type=int, default=400)
    p.add_argument("--hold-s", type=float, default=None,
                   help="the master's elastic_hold_s (default: the master's default)")
    p.add_argument("--min-dwell-s", type=float, default=None,
                   help="the master's elastic_min_dwell_s (default: the master's default)")
    p.add_argument("--log-dir", default=None)
    p.add_argument("--json", default=None)
    return p


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    log_dir = pathlib.Path(args.log_dir or tempfile.mkdtemp(prefix="bench-elastic-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    profile_path = args.profile or str(log_dir / "profile.json")
    if not args.profile:
        subprocess.run([sys.executable, "-m", "xllm_py.sim.profile", "--out", profile_path,
                        "--num-threads", "1"], check=True)
    profile = LatencyProfile.load(profile_path)
    ttft_ms = slo_defaults.ttft_target_ms([profile])
    tpot_ms = slo_defaults.tpot_target_ms([profile])
    trace = phases(profile, args.instances, ttft_ms, tpot_ms, args)
    overrides = {"elastic_hold_s": args.hold_s, "elastic_min_dwell_s": args.min_dwell_s}
    settings = write_settings(log_dir / "service.yaml",
                              {k: v for k, v in overrides.items() if v is not None})
    fleet = Fleet(profile_path, sim_model_dir("tiny"), log_dir,
                  service_args=["--elastic-pd", "on", *settings])
    result: dict[str, Any] = {"args": vars(args), "targets_ms": [ttft_ms, tpot_ms],
                              "trace": [dataclasses.asdict(p) for p in trace], "arms": []}
    print(json.dumps({k: result[k] for k in ("targets_ms", "trace")}), flush=True)
    try:
        fleet.start(num_services=1)
        fleet.add_engines("MIX", args.instances)
        await fleet.wait_all_active(240)
        names = [f"mix-{i}" for i in range(args.instances)]
        for i, arm in enumerate(args.arms.split(",")):
            if i:  # the last arm's requests leave the master's demand window: no arm
                await asyncio.sleep(ElasticConfig().window_s + 1)  # starts informed
            row = await run_arm(fleet, names, arm, trace, args, (ttft_ms, tpot_ms))
            result["arms"].append(row)
            print(json.dumps(row), flush=True)
    finally:
        fleet.stop()
    return result


def table(result: dict[str, Any]) -> str:
    arms = result["arms"]
    names = [p["phase"] for p in arms[0]["phases"]] + ["overall"]
    lines = ["| arm | " + " | ".join(f"{n} goodput/s (attain.)" for n in names) + " |",
             "|---" * (len(names) + 1) + "|"]
    for a in arms:
        cells = [f"{p['goodput']:.2f} ({p['attainment']:.0%})" for p in a["phases"]]
        o = a["overall"]
        cells.append(f"{o['goodput']:.2f} ({o['attainment']:.0%})")
        lines.append(f"| {a['arm']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = asyncio.run(amain(args))
    print(table(result))
    el = next((a for a in result["arms"] if a["arm"] == "elastic"), None)
    if el is not None:
        fixed = [a["overall"]["goodput"] for a in result["arms"] if a["arm"] != "elastic"]
        if fixed and max(fixed) > 0:
            print(f"elastic / best fixed split, overall: {el['overall']['goodput'] / max(fixed):.2f}x")
        print(f"elastic: {el['flips']} split changes, settled {el['settled_s']} s into each "
              f"phase; splits {el['splits']}")
    if args.json:
        pathlib.Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
