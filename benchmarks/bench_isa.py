"""The AVX2 and the AVX-512 kernel builds on the same decode step, interleaved.

    python benchmarks/bench_isa.py [--rounds 4] [--batch 1 32] [--threads 2] [--steps 12]
                                   [--model gemma-3-270m]

Runs ``bench_step_breakdown.py --json`` once per build per round, alternating
(``XLLM_CPU_ISA=avx2``, then ``avx512``), each in its own process: a shared machine's load
moves both builds' figures alike within a round, so the per-round ratios are the figure,
not the milliseconds. Prints, per batch, each build's median and range of the whole step,
the LM head, the block linears and the rest, and the median (min-max) of the per-round
AVX2 / AVX-512 ratios. Needs a CPU with AVX-512 (kernel_build.choose_isa).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ISAS = ("avx2", "avx512")


def one_run(isa: str, a: argparse.Namespace) -> list[dict]:
    cmd = [sys.executable, os.path.join(HERE, "bench_step_breakdown.py"), "--json",
           "--model", a.model, "--steps", str(a.steps), "--threads", str(a.threads),
           "--batch", *map(str, a.batch)]
    out = subprocess.run(cmd, env={**os.environ, "XLLM_CPU_ISA": isa}, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out[out.index("\n[") + 1:])


def figures(r: dict) -> dict[str, float]:
    p = r["parts_ms"]
    return {"step": r["step_ms"], "lm_head": p.get("lm_head", 0.0),
            "linears": p.get("linears", 0.0), "attention": p.get("attention", 0.0),
            "sampler": p.get("sampler", 0.0)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    # {isa: {batch: [figures per round]}}
    got: dict[str, dict[int, list[dict[str, float]]]] = {i: {} for i in ISAS}
    for rnd in range(a.rounds):
        for isa in ISAS if rnd % 2 == 0 else ISAS[::-1]:
            for r in one_run(isa, a):
                got[isa].setdefault(r["batch"], []).append(figures(r))
        print(f"round {rnd + 1}/{a.rounds} done, load {os.getloadavg()[0]:.1f}", flush=True)
    for b in a.batch:
        print(f"\n{a.model} batch {b}, {a.threads} threads, {a.rounds} rounds "
              f"(ms: median [min-max]; ratio avx2/avx512 per round)")
        for key in ("step", "lm_head", "linears", "attention", "sampler"):
            cols = []
            for isa in ISAS:
                v = [f[key] for f in got[isa][b]]
                cols.append(f"{isa} {statistics.median(v):7.1f} [{min(v):.1f}-{max(v):.1f}]")
            ratios = [x[key] / y[key] for x, y in zip(got["avx2"][b], got["avx512"][b])
                      if y[key] > 0]
            ratio = (f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]"
                     if ratios else "-")
            print(f"  {key:10s} {cols[0]:28s} {cols[1]:28s} {ratio}")
        if b > 1:
            vocab_flops = 2 * b * 640 * 262144 if a.model == "gemma-3-270m" else 0
            if vocab_flops:
                for isa in ISAS:
                    ms = statistics.median(f["lm_head"] for f in got[isa][b])
                    print(f"  LM head {isa}: {vocab_flops / ms / 1e6:.0f} GFLOP/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
