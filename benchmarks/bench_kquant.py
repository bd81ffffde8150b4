"""GGUF K-quant panels against float32 panels holding the same values (issue 28).

    python benchmarks/bench_kquant.py [--rows 1 32] [--threads N] [--repeat 15]

The matmuls of gemma-3-270m's Q4_K_M GGUF that are Q4_K or Q6_K (attention output
640 x 1024 Q4_K, MLP down 640 x 2048 Q4_K or Q6_K), each as many distinct copies as the
model has (18 / 9 / 9, so that they stream from memory, not from cache), on random blocks:
the K-quant kernel (kquant_panels.py, csrc/kquant.c) and the float32 panel kernel on the
dequantized weight (the same sums, bit for bit: checked here), alternating within each
repeat; the best of ``--repeat`` per call, the ratio and the bytes each streams per
second. The machine is shared: quote the ``load`` line; the ratio is the figure.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from xllm_py.model import cpu_kernels, kquant_panels  # noqa: E402

SHAPES = [("attention output", "Q4_K", 640, 1024, 18), ("MLP down", "Q4_K", 640, 2048, 9),
          ("MLP down", "Q6_K", 640, 2048, 9)]


def random_blocks(qtype: str, n: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    size = kquant_panels.TYPES[qtype][1]
    b = rng.integers(0, 256, (n, k // 256, size), dtype=np.uint8)
    scales = rng.normal(0, 0.01, (n, k // 256, 2)).astype(np.float16).view(np.uint8)
    if qtype == "Q4_K":
        b[..., 0:4] = scales.reshape(n, k // 256, 4)
    else:
        b[..., 208:210] = scales[..., 0:2]
    return b.reshape(n, -1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=15)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if not cpu_kernels.linear_available():
        print("native linear kernels unavailable here:", cpu_kernels.unavailable_reason())
        return 1
    print(f"load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores, "
          f"{torch.get_num_threads()} threads")
    for rows in a.rows:
        total = {"kq": 0.0, "f32": 0.0}
        for what, qtype, n, k, copies in SHAPES:
            kqs = [kquant_panels.from_blocks(qtype, random_blocks(qtype, n, k, i), k)
                   for i in range(copies)]
            f32s = [kq.dequantize_native() for kq in kqs]
            x = torch.randn(rows, k)
            for kq, p in zip(kqs, f32s):
                assert torch.equal(cpu_kernels.linear_panels_kquant(x, kq, None),
                                   cpu_kernels.linear_panels(x, p, n, None))
            best = {"kq": 1e9, "f32": 1e9}
            for _ in range(a.repeat):
                t = time.perf_counter()
                for kq in kqs:
                    cpu_kernels.linear_panels_kquant(x, kq, None)
                best["kq"] = min(best["kq"], (time.perf_counter() - t) / copies)
                t = time.perf_counter()
                for p in f32s:
                    cpu_kernels.linear_panels(x, p, n, None)
                best["f32"] = min(best["f32"], (time.perf_counter() - t) / copies)
            for key in total:
                total[key] += best[key] * copies
            kq_gb = kqs[0].nbytes / best["kq"] / 1e9
            f32_gb = f32s[0].numel() * 4 / best["f32"] / 1e9
            print(f"rows {rows:3d} {what:16s} {qtype} {n}x{k}: K-quant {best['kq'] * 1e6:7.1f} us "
                  f"({kq_gb:5.1f} GB/s, {kqs[0].nbytes / (n * k):.2f} B/weight)  float32 "
                  f"{best['f32'] * 1e6:7.1f} us ({f32_gb:5.1f} GB/s)  "
                  f"{best['f32'] / best['kq']:.2f}x")
        print(f"rows {rows:3d} all 36 (one decode step's): K-quant {total['kq'] * 1e3:.2f} ms, "
              f"float32 {total['f32'] * 1e3:.2f} ms: {total['f32'] / total['kq']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
