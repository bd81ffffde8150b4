"""An engine restart under load: SIGTERM one of two MIX engines mid-run, with the drain
(`--drain-timeout 30`, the default) and without it (`--drain-timeout 0`: its requests
migrate to the other engine once the service evicts it), same workload, same script.

Reported per mode: failed requests, the longest pause a client saw between two chunks of
a stream, latency p50/p99, wall time, and the drain / no-drain ratios.

    python benchmarks/bench_restart.py
    python benchmarks/bench_restart.py --requests 48 --concurrency 8 --output-len 256
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import pathlib
import signal
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import (random_token_prompts, report_environment,  # noqa: E402
                               run_load, summarize)

logger = logging.getLogger(__name__)


async def load_with_a_restart(url: str, victim, prompts, args) -> tuple[list, float, float]:
    """Run the load; SIGTERM `victim` after --stop-after-s. Returns (results, wall, exit s)."""
    load = asyncio.create_task(run_load(url, "tiny", prompts, max_tokens=args.output_len,
                                        concurrency=args.concurrency, stream=True,
                                        ignore_eos=True))
    await asyncio.sleep(args.stop_after_s)
    victim.popen.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    await asyncio.to_thread(victim.popen.wait, 120)
    exited_s = time.monotonic() - t0
    results, wall = await load
    return results, wall, exited_s


def run_mode(drain_timeout: float, prompts, args) -> dict:
    from xllm_py.launch import Cluster, build_parser

    log_dir = pathlib.Path(tempfile.mkdtemp(prefix=f"xllm-bench-restart-{drain_timeout:g}-"))
    argv = ["--mix", "2", "--http-port", str(args.port), "--log-dir", str(log_dir),
            f"--engine-arg=--drain-timeout={drain_timeout}"]
    cluster = Cluster(build_parser().parse_args(argv))
    try:
        cluster.start()
        victim = next(p for p in cluster.children if p.name.startswith("mix"))
        results, wall, exited_s = asyncio.run(
            load_with_a_restart(cluster.url, victim, prompts, args))
    finally:
        cluster.stop()
    ok = [r for r in results if r.ok]
    gaps = [max(r.itl_s) for r in ok if len(r.chunk_times_s) > 1]
    return {"failed": len(results) - len(ok), "max_pause_s": max(gaps, default=0.0),
            "latency_s": summarize([r.latency_s for r in ok], (50, 99)), "wall_s": wall,
            "exited_s": exited_s,
            "first_error": next((r.error for r in results if not r.ok), None)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--stop-after-s", type=float, default=2.0,
                   help="SIGTERM one engine this long after the load starts")
    p.add_argument("--port", type=int, default=18899)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    report_environment()
    prompts = random_token_prompts(args.requests, args.input_len, vocab_size=1000,
                                   seed=args.seed)
    print(f"2 MIX engines, {args.requests} streaming requests at concurrency "
          f"{args.concurrency} ({args.input_len} in, {args.output_len} out); one engine "
          f"gets SIGTERM {args.stop_after_s:g} s in")
    rows = {"no drain": run_mode(0, prompts, args), "drain": run_mode(30, prompts, args)}
    print(f"{'mode':<9} {'failed':>6} {'max pause s':>12} {'p50 s':>7} {'p99 s':>7} "
          f"{'wall s':>7} {'engine exit s':>14}")
    for mode, s in rows.items():
        print(f"{mode:<9} {s['failed']:>6} {s['max_pause_s']:>12.2f} "
              f"{s['latency_s']['p50']:>7.2f} {s['latency_s']['p99']:>7.2f} "
              f"{s['wall_s']:>7.2f} {s['exited_s']:>14.2f}")
        if s["first_error"]:
            print(f"  first error: {s['first_error']}")
    nd, d = rows["no drain"], rows["drain"]
    print(f"drain / no drain: max pause {d['max_pause_s'] / nd['max_pause_s']:.2f}x, "
          f"p99 {d['latency_s']['p99'] / nd['latency_s']['p99']:.2f}x, "
          f"wall {d['wall_s'] / nd['wall_s']:.2f}x")


if __name__ == "__main__":
    main()
