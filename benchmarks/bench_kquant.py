"""GGUF K-quant panels against float32 panels holding the same values (issue 28).

    python benchmarks/bench_kquant.py [--rows 1 32] [--threads N] [--repeat 15]

The 36 matmuls of a gemma-3-270m decode step whose GGUF weights are Q4_K or Q6_K
(per layer: attention output 640 x 1024 Q4_K, MLP down 640 x 2048 Q4_K or Q6_K as the file
has them), distinct random blocks each, in layer order: the K-quant kernel
(kquant_panels.py, csrc/kquant.c) and the float32 panel kernel on the dequantized weights
(the same sums, bit for bit: checked here), alternating within each repeat. Before each
pass a 128 MB buffer is read, as a step's other weights (the 180 MB LM head) would, so
neither set starts in the cache (the K-quant set, 22 MB, would fit the 32 MB L3). The best
pass of ``--repeat``, its ratio and the bytes streamed per second. The machine is shared:
quote the ``load`` line; the ratio is the figure.
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

# layer i: attention output Q4_K; MLP down Q6_K on layers 0 1 4 7 10 13 15 16 17, else Q4_K
Q6K_DOWN = {0, 1, 4, 7, 10, 13, 15, 16, 17}
SHAPES = [(f"{i}.o", "Q4_K", 640, 1024) for i in range(18)] + [
    (f"{i}.down", "Q6_K" if i in Q6K_DOWN else "Q4_K", 640, 2048) for i in range(18)]


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
    kqs = [kquant_panels.from_blocks(q, random_blocks(q, n, k, i), k)
           for i, (_, q, n, k) in enumerate(SHAPES)]
    f32s = [kq.dequantize_native() for kq in kqs]
    flush = torch.ones(32 * 2**20)  # 128 MB
    kq_mb = sum(kq.nbytes for kq in kqs) / 1e6
    f32_mb = sum(p.numel() * 4 for p in f32s) / 1e6
    for rows in a.rows:
        xs = [torch.randn(rows, k) for (_, _, _, k) in SHAPES]
        for x, kq, p in zip(xs, kqs, f32s):
            assert torch.equal(cpu_kernels.linear_panels_kquant(x, kq, None),
                               cpu_kernels.linear_panels(x, p, kq.out_features, None))
        best = {"kq": 1e9, "f32": 1e9}
        for _ in range(a.repeat):
            flush.sum()
            t = time.perf_counter()
            for x, kq in zip(xs, kqs):
                cpu_kernels.linear_panels_kquant(x, kq, None)
            best["kq"] = min(best["kq"], time.perf_counter() - t)
            flush.sum()
            t = time.perf_counter()
            for x, p, kq in zip(xs, f32s, kqs):
                cpu_kernels.linear_panels(x, p, kq.out_features, None)
            best["f32"] = min(best["f32"], time.perf_counter() - t)
        print(f"rows {rows:3d}, the 36 matmuls: K-quant {best['kq'] * 1e3:6.2f} ms "
              f"({kq_mb:.0f} MB, {kq_mb / 1e3 / best['kq']:.1f} GB/s)  float32 "
              f"{best['f32'] * 1e3:6.2f} ms ({f32_mb:.0f} MB, {f32_mb / 1e3 / best['f32']:.1f} GB/s)"
              f"  {best['f32'] / best['kq']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
