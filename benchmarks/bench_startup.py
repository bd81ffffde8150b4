"""Start-up time of an engine in a cluster with its latency profile measured at start-up
(the default: xllm_py/engine/self_profile.py) and without it (`latency_profile: off`).

Stages: an embedded etcd -> per round, for each mode in turn: start one DECODE engine
process (--etcd, --model) pinned to a core, time from spawn until its HTTP API answers
(it registers in etcd first), read how long its profile took from its log, stop it ->
median seconds per mode, the difference and the ratio; versions and load average.

    python benchmarks/bench_startup.py --model tiny-25m --rounds 3
"""
from __future__ import annotations

import argparse
import os
import pathlib
import re
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import report_environment  # noqa: E402
from xllm_py.cluster.etcd_server import EmbeddedEtcd  # noqa: E402
from xllm_py.utils.config_file import write_settings  # noqa: E402
from xllm_py.utils.procs import engine_args, free_port, spawn  # noqa: E402

MODES = {"profiled": {}, "off": {"latency_profile": "off"}}
MEASURED = re.compile(r"latency profile measured in ([0-9.]+) s \((\d+) step shapes")


def start_once(etcd: str, model: str, settings: dict, log_dir: pathlib.Path, name: str,
               cpu: int | None) -> tuple[float, str]:
    port = free_port()
    extra = write_settings(log_dir / f"{name}.yaml", settings)
    t0 = time.monotonic()
    proc = spawn(name, "xllm_py.engine",
                 engine_args("DECODE", port, etcd=etcd, model=model,
                             extra=["--etcd-namespace", f"{name}/", *extra]),
                 log_dir, http_url=f"http://127.0.0.1:{port}", cpu=cpu)
    try:
        proc.wait_ready(600)
        return time.monotonic() - t0, proc.log_path.read_text(errors="replace")
    finally:
        proc.terminate()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/bench_startup.py",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-25m")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cpu", type=int, default=0, help="core to pin the engine to (-1: none)")
    args = p.parse_args(argv)
    report_environment()
    log_dir = pathlib.Path(tempfile.mkdtemp(prefix="xllm-startup-"))
    etcd = EmbeddedEtcd(host="127.0.0.1").start()
    times: dict[str, list[float]] = {m: [] for m in MODES}
    profile_s: list[float] = []
    try:
        start_once(etcd.endpoint, args.model, MODES["off"], log_dir, "warm", None)  # caches
        for i in range(args.rounds):
            for mode, extra in MODES.items():
                s, log = start_once(etcd.endpoint, args.model, extra, log_dir, f"{mode}-{i}",
                                    None if args.cpu < 0 else args.cpu)
                times[mode].append(s)
                if m := MEASURED.search(log):
                    profile_s.append(float(m.group(1)))
                print(f"round {i + 1} {mode:>8}: ready in {s:.2f} s", flush=True)
    finally:
        etcd.stop()
    on, off = (statistics.median(times[m]) for m in ("profiled", "off"))
    print(f"\nload average {os.getloadavg()}; model {args.model}, {args.rounds} round(s)")
    print(f"engine ready (median): profiled {on:.2f} s, latency_profile off {off:.2f} s: "
          f"+{on - off:.2f} s ({on / off:.2f}x)")
    if profile_s:
        print(f"the profile itself (engine log): {min(profile_s):.2f}-{max(profile_s):.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
