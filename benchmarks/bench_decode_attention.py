"""Decode attention on CPU: the native paged kernel against a streaming read of its bytes.

A decode step's attention reads every context token's K and V of every layer once; with a
few long contexts that is the step's largest cost (issue 16's burst: 15 streams of ~1500
tokens). Stages: a pool of ``--layers`` layers' caches larger than the last-level cache,
each case's sequences given blocks scattered over it (``--layout scattered``, as a pool
holds them after some churn) or in order -> one step, every layer's
``paged_decode_attention`` in turn (so each layer's blocks come from memory), timed
``--repeat`` times (median) -> the same bytes read as one contiguous ``sum`` (the
baseline: what a plain stream of those bytes costs on this core) -> a table of ms a step,
us per context token and layer, and the kernel's effective bandwidth over the baseline's.

    python benchmarks/bench_decode_attention.py --num-threads 1
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as `python benchmarks/...py` from a clone
    sys.path.insert(0, str(ROOT))

from benchmarks.common import report_environment, time_call_ms  # noqa: E402
from xllm_py.model import cpu_kernels  # noqa: E402
from xllm_py.model.attention import allocate_kv_caches  # noqa: E402


def run_case(caches: list, num_seqs: int, context: int, heads: int, layout: str,
             repeat: int, gen: torch.Generator) -> dict:
    k0 = caches[0][0]
    num_blocks, block_size, kv_heads, head_dim = k0.shape
    per_seq = -(-context // block_size)
    if num_seqs * per_seq > num_blocks:
        raise SystemExit(f"{num_seqs} x {context} tokens need {num_seqs * per_seq} blocks; "
                         f"the pool has {num_blocks} (raise --pool-blocks)")
    order = (torch.randperm(num_blocks, generator=gen) if layout == "scattered"
             else torch.arange(num_blocks))
    tables = order[:num_seqs * per_seq].view(num_seqs, per_seq).contiguous()
    seq_lens = torch.full((num_seqs,), context, dtype=torch.int64)
    q = torch.randn(num_seqs, heads, head_dim, generator=gen)
    scale = head_dim ** -0.5
    outs: list[torch.Tensor] = []

    def step() -> None:
        outs.clear()
        for kc, vc in caches:
            outs.append(cpu_kernels.paged_decode_attention(q, kc, vc, tables, seq_lens, scale))

    step_ms = time_call_ms(step, repeat, statistics.median)
    # the same number of bytes, contiguous: K then V of each layer's first blocks
    nbytes = len(caches) * 2 * num_seqs * context * kv_heads * head_dim * 4
    flat = [c.reshape(-1)[:num_seqs * context * kv_heads * head_dim] for kv in caches for c in kv]
    stream_ms = time_call_ms(lambda: [x.sum() for x in flat], repeat, statistics.median)
    tokens = num_seqs * context * len(caches)
    return {"seqs": num_seqs, "context": context, "layout": layout,
            "step_ms": round(step_ms, 3), "us_per_token_layer": round(step_ms * 1000 / tokens, 4),
            "kernel_gb_s": round(nbytes / step_ms / 1e6, 2),
            "stream_gb_s": round(nbytes / stream_ms / 1e6, 2),
            "kernel_over_stream": round(stream_ms / step_ms, 3),
            "checksum": float(sum(o.double().sum() for o in outs))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=["15x1500", "4x800", "32x400", "32x96"],
                    help="SEQSxCONTEXT: sequences in the step and context tokens of each")
    ap.add_argument("--layout", choices=("scattered", "ordered"), nargs="+",
                    default=["scattered", "ordered"])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--pool-blocks", type=int, default=4096,
                    help="blocks of the pool (default: 4096 x 16 tokens, 1 GiB for 8 layers)")
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--num-threads", type=int, default=1)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.num_threads)
    if not cpu_kernels.available():
        raise SystemExit(f"the native kernels are not available: {cpu_kernels.unavailable_reason()}")
    result: dict = {"args": vars(args)}
    report_environment(result)
    caches = allocate_kv_caches(args.layers, args.pool_blocks, args.block_size,
                                args.kv_heads, args.head_dim)
    gen = torch.Generator().manual_seed(0)
    for kc, vc in caches:
        kc.normal_(generator=gen)
        vc.normal_(generator=gen)
    print(f"{args.layers} layers, {args.heads} heads ({args.kv_heads} KV) of {args.head_dim}, "
          f"block {args.block_size}, pool {args.pool_blocks} blocks, "
          f"{args.num_threads} thread(s); median of {args.repeat}")
    print(f"{'seqs x ctx':>11} {'layout':>9} {'ms/step':>8} {'us/tok-layer':>13} "
          f"{'kernel GB/s':>12} {'stream GB/s':>12} {'kernel/stream':>14}")
    rows = []
    for case in args.cases:
        seqs, ctx = (int(x) for x in case.split("x"))
        for layout in args.layout:
            r = run_case(caches, seqs, ctx, args.heads, layout, args.repeat, gen)
            rows.append(r)
            print(f"{case:>11} {layout:>9} {r['step_ms']:>8.2f} {r['us_per_token_layer']:>13.3f} "
                  f"{r['kernel_gb_s']:>12.1f} {r['stream_gb_s']:>12.1f} "
                  f"{r['kernel_over_stream']:>13.2f}x", flush=True)
    result["cases"] = rows
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
