"""`python -m benchmarks.fleet_service --route-times FILE [service flags]`: xllm_service
with its routing decisions timed, for bench_fleet.py.

The service process unchanged, except that every `Router.route` call (pick a prefill and a
decode, or a MIX instance, from the instance table) is timed with perf_counter_ns; twice a
second the nanoseconds of all calls so far are written to FILE (JSON list, replaced
atomically), so the benchmark reads them per phase without talking to the process.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

ROUTE_TIMES_NS: list[int] = []


def instrument() -> None:
    from xllm_service.router import Router

    route = Router.route

    def timed_route(self, *args, **kwargs):
        t0 = time.perf_counter_ns()
        try:
            return route(self, *args, **kwargs)
        finally:
            ROUTE_TIMES_NS.append(time.perf_counter_ns() - t0)

    Router.route = timed_route


def dump_forever(path: str, period_s: float = 0.5) -> None:
    while True:
        time.sleep(period_s)
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(ROUTE_TIMES_NS[:], f)
        os.replace(tmp, path)


def main() -> int:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--route-times", required=True)
    args, rest = p.parse_known_args()
    instrument()
    threading.Thread(target=dump_forever, args=(args.route_times,), daemon=True).start()
    from xllm_service.__main__ import main as service_main

    return service_main(rest)


if __name__ == "__main__":
    sys.exit(main())
