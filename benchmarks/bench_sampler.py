"""The sampler's random rows: the native draw (csrc/sample.c) against torch's
(compute_probs + the inverse-CDF draw), interleaved, on rows of a large vocabulary.

    python benchmarks/bench_sampler.py [--rows 16] [--vocab 262144] [--scale 3 8]
                                       [--rounds 5] [--threads N]

Logits are random normals times ``--scale`` (3: a flat row, whose top_p keeps most of the
vocabulary; 8: a peaked one, as a trained model's); each setting of temperature / top_k /
top_p / min_p samples ``--rows`` rows with both paths, alternating which goes first, and
reports the median ms of each and torch / native (the speed-up). The same uniforms give
the same tokens (checked: the count of rows that differ is printed).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from xllm_py.engine import sampler as sampler_mod  # noqa: E402
from xllm_py.engine.sampler import Sampler, SamplingRow  # noqa: E402
from xllm_py.sampling_params import SamplingParams  # noqa: E402

SETTINGS = [dict(temperature=1.0), dict(temperature=0.7, top_k=50),
            dict(temperature=1.0, top_p=0.9), dict(temperature=0.7, top_p=0.95, top_k=100),
            dict(temperature=1.0, min_p=0.05)]


def _sample(logits: torch.Tensor, rows: list, native: bool) -> tuple[float, list[int]]:
    real = sampler_mod.sample_rows
    if not native:
        sampler_mod.sample_rows = lambda *a: None
    try:
        t = time.perf_counter()
        ids = Sampler(seed=0)(logits, rows).token_ids
        return (time.perf_counter() - t) * 1e3, ids
    finally:
        sampler_mod.sample_rows = real


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=262144)
    ap.add_argument("--scale", type=float, nargs="+", default=[3.0, 8.0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    print(f"load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; {a.rows} rows x {a.vocab} logits")
    g = torch.Generator().manual_seed(0)
    for scale in a.scale:
        logits = torch.randn(a.rows, a.vocab, generator=g) * scale
        for params in SETTINGS:
            rows = [SamplingRow(SamplingParams(**params)) for _ in range(a.rows)]
            ms = {True: [], False: []}
            differ = 0
            for r in range(a.rounds + 1):
                out = {}
                for native in ((True, False) if r % 2 else (False, True)):
                    t, out[native] = _sample(logits, rows, native)
                    if r:  # (round 0 warms up)
                        ms[native].append(t)
                differ += sum(x != y for x, y in zip(out[True], out[False]))
            nat, tor = statistics.median(ms[True]), statistics.median(ms[False])
            print(f"scale {scale:g} {params}: torch {tor:.1f} ms, native {nat:.1f} ms, "
                  f"{tor / nat:.1f}x; rows differing {differ}")
    print(f"load {os.getloadavg()[0]:.1f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
