"""Cache-aware routing against least-load routing, same workload, same script.

Two MIX engines behind the service, each with a prefix cache too small for every prompt
family but large enough for half of them. Requests of F families (a shared prefix of P
tokens and a unique suffix) arrive in a seeded random order at a given concurrency.
Least-load spreads every family over both engines, whose LRU caches then evict each
other's prefixes; CACHE_AWARE keeps a family on the engine that holds it. Reported per
policy: prefix-cache hit rate (engines' `xllm_prefix_cache_hit_tokens_total` over the
prompt tokens sent), TTFT and wall time, and the CACHE_AWARE / LEAST_LOAD ratios.

    python benchmarks/bench_cache_routing.py
    python benchmarks/bench_cache_routing.py --families 12 --prefix-len 1024 --requests 144
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import pathlib
import random
import re
import sys
import tempfile

import httpx

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import report_environment, run_load, summarize_load  # noqa: E402

logger = logging.getLogger(__name__)


def workload(args) -> list[list[int]]:
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(5, args.vocab_size) for _ in range(args.prefix_len)]
                for _ in range(args.families)]
    order = [i % args.families for i in range(args.requests)]
    rng.shuffle(order)
    return [prefixes[f] + [rng.randrange(5, args.vocab_size) for _ in range(args.suffix_len)]
            for f in order]


def engine_hits(urls: list[str]) -> float:
    total = 0.0
    for url in urls:
        text = httpx.get(url + "/metrics", timeout=5, trust_env=False).text
        m = re.search(r"^xllm_prefix_cache_hit_tokens_total ([0-9.e+]+)$", text, re.M)
        total += float(m.group(1)) if m else 0.0
    return total


def run_policy(policy: str, prompts: list[list[int]], args) -> dict:
    from xllm_py.launch import Cluster, build_parser

    log_dir = pathlib.Path(tempfile.mkdtemp(prefix=f"xllm-bench-{policy.lower()}-"))
    argv = ["--mix", "2", "--http-port", str(args.port), "--log-dir", str(log_dir),
            f"--service-arg=--load-balance-policy={policy}",
            f"--engine-arg=--num-blocks={args.num_blocks}",
            f"--engine-arg=--block-size={args.block_size}"]
    cluster = Cluster(build_parser().parse_args(argv))
    try:
        cluster.start()
        engines = [p.http_url for p in cluster.children if p.name.startswith("mix")]
        hits0 = engine_hits(engines)
        results, wall = asyncio.run(run_load(cluster.url, "tiny", prompts,
                                             max_tokens=args.output_len,
                                             concurrency=args.concurrency, stream=True,
                                             ignore_eos=True))
        summary = summarize_load(results, wall)
        if summary["num_failed"]:
            raise RuntimeError(f"{policy}: {summary['num_failed']} requests failed, the first: "
                               f"{summary.get('first_error')}")
        summary["hit_rate"] = (engine_hits(engines) - hits0) / sum(len(p) for p in prompts)
        return summary
    finally:
        cluster.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", type=int, default=12)
    p.add_argument("--prefix-len", type=int, default=768)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--requests", type=int, default=120)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=400,
                   help="per engine: about half of the families' prefixes fit (default)")
    p.add_argument("--vocab-size", type=int, default=1000)
    p.add_argument("--port", type=int, default=18888)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    report_environment()
    prompts = workload(args)
    need = args.families * (args.prefix_len // args.block_size)
    print(f"{args.families} families x {args.prefix_len}-token prefix ({need} blocks in all), "
          f"{args.num_blocks} blocks per engine, {args.requests} requests at concurrency "
          f"{args.concurrency}, {args.output_len} tokens out")
    rows = {policy: run_policy(policy, prompts, args) for policy in ("LEAST_LOAD", "CACHE_AWARE")}
    print(f"{'policy':<12} {'hit rate':>9} {'TTFT p50 ms':>12} {'TTFT mean ms':>13} {'wall s':>8} {'failed':>7}")
    for policy, s in rows.items():
        print(f"{policy:<12} {s['hit_rate']:>9.1%} {s['ttft_s']['p50'] * 1000:>12.1f} "
              f"{s['ttft_s']['mean'] * 1000:>13.1f} {s['wall_s']:>8.2f} {s['num_failed']:>7}")
    ll, ca = rows["LEAST_LOAD"], rows["CACHE_AWARE"]
    print(f"CACHE_AWARE / LEAST_LOAD: TTFT p50 {ca['ttft_s']['p50'] / ll['ttft_s']['p50']:.2f}x, "
          f"mean {ca['ttft_s']['mean'] / ll['ttft_s']['mean']:.2f}x, wall "
          f"{ca['wall_s'] / ll['wall_s']:.2f}x, hit rate {ll['hit_rate']:.1%} -> {ca['hit_rate']:.1%}")


if __name__ == "__main__":
    main()
