"""The service's own overhead: p50 TTFT through xllm_service minus p50 TTFT direct to the
engine, same MIX engine, 1 output token, requests interleaved in one run.

    python benchmarks/bench_service_overhead.py [--requests 200] [--json] [--tls]

`--tls`: a second stack (etcd, service, engine) with mutual TLS on every gRPC hop and etcd
and an API key on both HTTP APIs runs next to the plaintext one; the requests of the four
paths are interleaved, and the cost of TLS is the TLS stack's overhead minus the plain one's.
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
from xllm_py.cluster.certs import make_cluster_certs  # noqa: E402
from xllm_py.cluster.etcd_server import EmbeddedEtcd  # noqa: E402
from xllm_py.tls import TLSConfig  # noqa: E402
from xllm_py.utils.procs import engine_args, free_port, spawn  # noqa: E402

API_KEY = "sk-bench"


def ttft_ms(http: httpx.Client, url: str, prompt: str, key: str | None = None) -> float:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "stream": True,
            "temperature": 0}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    t0 = time.perf_counter()
    with http.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
        for line in r.iter_lines():
            if line.startswith("data:") and '"text"' in line:
                return (time.perf_counter() - t0) * 1000
    raise RuntimeError("no token")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def start_stack(logs: pathlib.Path, tls: bool, procs: list, etcds: list):
    """etcd + service + MIX engine (with `tls`: certificates, mutual TLS, an API key).
    Returns (service, engine)."""
    sec: dict[str, list[str]] = {"service": [], "engine": []}
    etcd_tls = None
    if tls:
        issued = make_cluster_certs(logs / "certs", ("etcd", "service", "engine"))
        etcd_tls = TLSConfig(issued["etcd"].cert, issued["etcd"].key, issued["etcd"].ca)
        for name in sec:
            sec[name] = ["--tls-cert", issued[name].cert, "--tls-key", issued[name].key,
                         "--tls-ca", issued[name].ca, "--etcd-cacert", issued[name].ca,
                         "--etcd-cert", issued[name].cert, "--etcd-key", issued[name].key,
                         "--api-key", API_KEY]
    etcd = EmbeddedEtcd(tls=etcd_tls).start()
    etcds.append(etcd)
    tag = "-tls" if tls else ""
    hp, rp, ep = free_port(), free_port(), free_port()
    svc = spawn(f"service{tag}", "xllm_service", ["--etcd", etcd.endpoint, "--model", "tiny",
                                                  "--http-port", str(hp),
                                                  "--rpc-port", str(rp), *sec["service"]], logs,
                http_url=f"http://127.0.0.1:{hp}")
    eng = spawn(f"engine{tag}", "xllm_py.engine",
                engine_args("MIX", ep, etcd=etcd.endpoint, extra=sec["engine"]),
                logs, http_url=f"http://127.0.0.1:{ep}")
    procs += [svc, eng]
    return svc, eng


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--tls", action="store_true",
                    help="also run a mutual-TLS + API-key stack and report the cost of TLS")
    args = ap.parse_args()
    logs = pathlib.Path(tempfile.mkdtemp(prefix="bench-svc-"))
    procs: list = []
    etcds: list = []
    try:
        svc, eng = start_stack(logs, False, procs, etcds)
        tsvc, teng = start_stack(logs, True, procs, etcds) if args.tls else (None, None)
        for p in (eng, teng):
            if p is not None:
                p.wait_ready(180)
        for p in (svc, tsvc):
            if p is not None:
                p.wait_ready(60, path="/readiness")
        paths = [("direct", eng.http_url, None), ("service", svc.http_url, None)]
        if tsvc is not None:
            paths += [("tls_direct", teng.http_url, API_KEY), ("tls_service", tsvc.http_url, API_KEY)]
        ttfts: dict[str, list[float]] = {name: [] for name, _, _ in paths}
        with httpx.Client(timeout=30, trust_env=False) as http:
            for i in range(20):  # warm-up every path
                for _, url, key in paths:
                    ttft_ms(http, url, f"warm {i}", key)
            for i in range(args.requests):
                for name, url, key in paths:
                    ttfts[name].append(ttft_ms(http, url, f"Hello number {i}", key))
        result: dict[str, float] = {"requests": args.requests}
        for name, xs in ttfts.items():
            result[f"{name}_p50_ms"] = statistics.median(xs)
            result[f"{name}_p90_ms"] = pct(xs, 0.9)
        result["overhead_p50_ms"] = result["service_p50_ms"] - result["direct_p50_ms"]
        if tsvc is not None:
            result["tls_overhead_p50_ms"] = result["tls_service_p50_ms"] - result["tls_direct_p50_ms"]
            result["tls_cost_p50_ms"] = result["tls_overhead_p50_ms"] - result["overhead_p50_ms"]
            result["tls_service_vs_plain_p50"] = result["tls_service_p50_ms"] / result["service_p50_ms"]
        report_environment(result, file=sys.stderr if args.json else sys.stdout)
        if args.json:
            print(json.dumps(result))
        else:
            print(f"TTFT p50 direct {result['direct_p50_ms']:.2f} ms, through service "
                  f"{result['service_p50_ms']:.2f} ms: overhead {result['overhead_p50_ms']:.2f} ms "
                  f"(p90 {result['direct_p90_ms']:.2f} vs {result['service_p90_ms']:.2f} ms, "
                  f"{args.requests} requests each, interleaved)")
            if tsvc is not None:
                print(f"mutual TLS + API key: TTFT p50 direct {result['tls_direct_p50_ms']:.2f} ms, "
                      f"through service {result['tls_service_p50_ms']:.2f} ms: overhead "
                      f"{result['tls_overhead_p50_ms']:.2f} ms (p90 {result['tls_direct_p90_ms']:.2f} "
                      f"vs {result['tls_service_p90_ms']:.2f} ms); TLS costs "
                      f"{result['tls_cost_p50_ms']:+.2f} ms p50 on the service path "
                      f"(service TTFT {result['tls_service_vs_plain_p50']:.3f}x plain)")
        return 0
    finally:
        for p in procs:
            p.terminate()
        for etcd in etcds:
            etcd.stop()


if __name__ == "__main__":
    sys.exit(main())
