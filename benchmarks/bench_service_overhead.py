"""The service's own overhead: p50 TTFT through xllm_service minus p50 TTFT direct to the
engine, same MIX engine, 1 output token, requests interleaved in one run.

    python benchmarks/bench_service_overhead.py [--requests 200] [--json]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import time

import httpx

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import report_environment  # noqa: E402
from xllm_py.cluster.etcd_server import EmbeddedEtcd  # noqa: E402
from xllm_py.utils.procs import engine_args, free_port, spawn  # noqa: E402


def ttft_ms(http: httpx.Client, url: str, prompt: str) -> float:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "stream": True,
            "temperature": 0}
    t0 = time.perf_counter()
    with http.stream("POST", url + "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data:") and '"text"' in line:
                return (time.perf_counter() - t0) * 1000
    raise RuntimeError("no token")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    logs = pathlib.Path(tempfile.mkdtemp(prefix="bench-svc-"))
    etcd = EmbeddedEtcd().start()
    procs = []
    try:
        hp, rp, ep = free_port(), free_port(), free_port()
        svc = spawn("service", "xllm_service", ["--etcd", etcd.endpoint, "--http-port", str(hp),
                                                "--rpc-port", str(rp)], logs,
                    http_url=f"http://127.0.0.1:{hp}")
        eng = spawn("engine", "xllm_py.engine", engine_args("MIX", ep, etcd=etcd.endpoint),
                    logs, http_url=f"http://127.0.0.1:{ep}")
        procs += [svc, eng]
        eng.wait_ready(180)
        svc.wait_ready(60, path="/readiness")
        direct, via = [], []
        with httpx.Client(timeout=30, trust_env=False) as http:
            for i in range(20):  # warm-up both paths
                ttft_ms(http, eng.http_url, f"warm {i}")
                ttft_ms(http, svc.http_url, f"warm {i}")
            for i in range(args.requests):
                prompt = f"Hello number {i}"
                direct.append(ttft_ms(http, eng.http_url, prompt))
                via.append(ttft_ms(http, svc.http_url, prompt))
        result = {
            "requests": args.requests,
            "direct_p50_ms": statistics.median(direct), "service_p50_ms": statistics.median(via),
            "direct_p90_ms": pct(direct, 0.9), "service_p90_ms": pct(via, 0.9),
            "overhead_p50_ms": statistics.median(via) - statistics.median(direct),
        }
        report_environment(result, file=sys.stderr if args.json else sys.stdout)
        if args.json:
            print(json.dumps(result))
        else:
            print(f"TTFT p50 direct {result['direct_p50_ms']:.2f} ms, through service "
                  f"{result['service_p50_ms']:.2f} ms: overhead {result['overhead_p50_ms']:.2f} ms "
                  f"(p90 {result['direct_p90_ms']:.2f} vs {result['service_p90_ms']:.2f} ms, "
                  f"{args.requests} requests each, interleaved)")
        return 0
    finally:
        for p in procs:
            p.terminate()
        etcd.stop()


if __name__ == "__main__":
    sys.exit(main())
