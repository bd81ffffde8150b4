"""The prefill queue's order in a queue simulation: FCFS vs the deadline order.

Stages: the long prompts of the mixed workload (``--long-frac`` of Poisson arrivals at
``--rate``, lengths uniform in ``--long-len``) and ``--short-at-prefill`` of its short ones
(``--short-len``; the rest are prefilled on the decode, issue 16's conditional
disaggregation) -> one prefill instance computing one prompt
at a time, its time from the latency profile (``--profile``; default: tiny-25m's figures
of this round) -> the next prompt chosen when the running one is ``--lead`` seconds from
done, FCFS or by ``prefill_order.pick`` (the engine's own function) -> share of prompts
whose first token came within ``--ttft-ms`` of arrival (long and short apart), over
``--seeds`` workloads.
The engine's order is measured end to end by ``bench_serving.py --compare``; this isolates
the queue from the rest (no HTTP, KV transfer or decode).

    python benchmarks/bench_prefill_order.py --rate 2.4
"""
from __future__ import annotations

import argparse
import pathlib
import random
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as `python benchmarks/...py` from a clone
    sys.path.insert(0, str(ROOT))

from benchmarks.common import report_environment  # noqa: E402
from xllm_py.cluster.latency_profile import LatencyProfile  # noqa: E402
from xllm_py.cluster.prefill_order import Queued, pick  # noqa: E402

# tiny-25m, one core (`python -m xllm_py.sim.profile --model tiny-25m --num-threads 1`)
DEFAULT_PROFILE = LatencyProfile(prefill_base_ms=3.2, prefill_ms_per_token=0.50,
                                 decode_base_ms=5.2, decode_ms_per_seq=0.55,
                                 decode_ms_per_ctx_token=0.0019, prefill_ms_per_kpair=0.275)


def simulate(order: str, rate: float, lead: float, seed: int, args,
             profile: LatencyProfile) -> dict[bool, tuple[int, int]]:
    """{long?: (prompts in time, prompts)} of one workload."""
    rng = random.Random(seed)
    t, arrivals = 0.0, []
    for _ in range(args.num_requests):
        t += rng.expovariate(rate)
        if rng.random() < args.long_frac:
            arrivals.append((t, rng.randint(*args.long_len)))
        elif rng.random() < args.short_at_prefill:
            arrivals.append((t, args.short_len))
    slo = args.ttft_ms / 1000.0
    cost = {n: profile.prefill_ms(n) / 1000.0 * args.slowdown for _, n in arrivals}
    queue: list[tuple[float, int]] = []
    free_at, i = 0.0, 0
    counts = {True: [0, 0], False: [0, 0]}
    while i < len(arrivals) or queue:
        now = max(free_at - lead, 0.0)
        if not queue and arrivals[i][0] > now:
            now = arrivals[i][0]
        while i < len(arrivals) and arrivals[i][0] <= now:
            queue.append(arrivals[i])
            i += 1
        start = max(now, free_at)
        index = 0
        if order == "deadline":
            index = pick([Queued(a + slo, cost[n]) for a, n in queue], now, start - now)
        arrival, n = queue.pop(index)
        free_at = start + cost[n]
        c = counts[n > args.short_len]
        c[0] += free_at - arrival <= slo
        c[1] += 1
    return {k: (v[0], v[1]) for k, v in counts.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default=None, help="latency profile JSON (default: tiny-25m's)")
    ap.add_argument("--rate", type=float, nargs="+", default=[1.6, 2.0, 2.4],
                    help="requests per second, all prompts (the long ones are --long-frac)")
    ap.add_argument("--long-frac", type=float, default=0.3)
    ap.add_argument("--long-len", type=int, nargs=2, default=[1024, 1920])
    ap.add_argument("--short-len", type=int, default=128)
    ap.add_argument("--short-at-prefill", type=float, default=0.15,
                    help="share of the short prompts sent to the prefill (the rest: decode)")
    ap.add_argument("--num-requests", type=int, default=100)
    ap.add_argument("--ttft-ms", type=float, default=2500.0)
    ap.add_argument("--slowdown", type=float, default=1.1,
                    help="wall clock over the profile (a shared machine runs slower)")
    ap.add_argument("--lead", type=float, nargs="+", default=[0.2, 1.3],
                    help="seconds before the running prompt ends that the next is chosen")
    ap.add_argument("--seeds", type=int, default=60)
    args = ap.parse_args(argv)
    report_environment()
    profile = LatencyProfile.load(args.profile) if args.profile else DEFAULT_PROFILE
    print(f"{'rate':>5} {'order':>9} {'lead s':>7} {'long in time':>13} {'short in time':>14}")
    for rate in args.rate:
        for order, leads in (("fcfs", [0.0]), ("deadline", args.lead)):
            for lead in leads:
                runs = [simulate(order, rate, lead, s, args, profile)
                        for s in range(args.seeds)]
                share = {k: sum(r[k][0] for r in runs) / max(1, sum(r[k][1] for r in runs))
                         for k in (True, False)}
                print(f"{rate:>5.1f} {order:>9} {lead:>7.1f} {share[True]:>13.0%} "
                      f"{share[False]:>14.0%}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
