"""How much the SLO a cluster states without flags moves from one start to the next.

The service derives its TTFT / TPOT targets from the latency profiles its engines measure
at start-up (xllm_py/engine/self_profile.py, xllm_py/cluster/slo_defaults.py); the
goodput of bench_serving is counted against them, so a start that measures a slower
machine than the last one moves the bar.

Stages: per start, the cluster bench_serving's `default` set-up is (`python -m
xllm_py.launch --prefill 1 --decode 1`, no other flag) as the launcher starts it (embedded etcd, engines pinned to cores) -> wait until the service states both
targets (its /metrics) -> the targets and the decode's profile line from its log -> stop
-> the range and the spread (max / min) of each target over the starts, the median
profile time; versions and load average.

    python benchmarks/bench_stated_targets.py --model tiny-25m --starts 6
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import report_environment  # noqa: E402
from benchmarks.serving_rounds import stated_slo  # noqa: E402
from benchmarks.bench_serving import SETUPS, STATES_SLO  # noqa: E402
from benchmarks.bench_startup import MEASURED  # noqa: E402

WAIT_S = 60.0


def one_start(model: str, log_dir: pathlib.Path) -> tuple[tuple[float, float], float]:
    """(TTFT, TPOT) targets the service states, and how long the decode's profile took."""
    from xllm_py.launch import Cluster, build_parser
    from xllm_py.utils.procs import free_port

    cluster = Cluster(build_parser().parse_args(
        [*SETUPS[STATES_SLO][1], "--model", model, "--http-port", str(free_port()),
         "--log-dir", str(log_dir), "--log-level", "WARNING", "--pin-cores"]))
    cluster.start()
    try:
        deadline = time.monotonic() + WAIT_S
        while True:
            stated = stated_slo(cluster.url)
            if stated and stated[0] > 0 and stated[1] > 0:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"no targets stated within {WAIT_S:.0f} s (logs {log_dir})")
            time.sleep(0.2)
        took = [float(m.group(1)) for f in log_dir.glob("decode*.log")
                for m in MEASURED.finditer(f.read_text())]
        return stated, took[0] if took else float("nan")
    finally:
        cluster.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-25m")
    p.add_argument("--starts", type=int, default=6)
    args = p.parse_args()
    report_environment()
    targets, took = [], []
    root = pathlib.Path(tempfile.mkdtemp(prefix="xllm-targets-"))
    for i in range(args.starts):
        stated, secs = one_start(args.model, root / f"start{i}")
        targets.append(stated)
        took.append(secs)
        print(f"start {i + 1}: TTFT <= {stated[0]:.0f} ms, TPOT <= {stated[1]:.1f} ms "
              f"(decode profiled in {secs:.1f} s)", flush=True)
    for name, xs in (("TTFT", [t[0] for t in targets]), ("TPOT", [t[1] for t in targets])):
        print(f"{name} target over {len(xs)} starts: {min(xs):.1f}-{max(xs):.1f} ms, median "
              f"{statistics.median(xs):.1f}, max / min {max(xs) / min(xs):.2f}")
    print(f"profile time median {statistics.median(took):.1f} s (logs {root})")


if __name__ == "__main__":
    main()
