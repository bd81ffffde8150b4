"""Prompt attention on CPU: the paged per-token kernel vs the dense (SDPA) path.

Stages: for each prompt length, one layer's K/V of a whole prompt written into a paged
cache (blocks in table order, as a fresh prompt gets them) -> the paged path (every prompt
token a decode query over its causal prefix, the native kernel reading blocks in place)
and the dense path (the context gathered once, causal ``scaled_dot_product_attention``),
each timed ``--repeat`` times (min) -> a table of ms per layer and dense/paged, with the
largest difference of the two outputs. ``--prefix`` times a chunk of that many tokens
after a cached prefix instead of a whole prompt (the dense path then takes a mask).

    python benchmarks/bench_attention.py --num-threads 1
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as `python benchmarks/...py` from a clone
    sys.path.insert(0, str(ROOT))

from benchmarks.common import report_environment, time_call_ms  # noqa: E402
from xllm_py.model import attention  # noqa: E402
from xllm_py.model.attention import AttentionMetadata, allocate_kv_caches, attend, write_kv  # noqa: E402


def run_case(num_tokens: int, prefix: int, heads: int, kv_heads: int, head_dim: int,
             block_size: int, repeat: int) -> dict:
    total = prefix + num_tokens
    nblk = -(-total // block_size) + 1
    (kc, vc), = allocate_kv_caches(1, nblk, block_size, kv_heads, head_dim)
    table = list(range(1, nblk))
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(num_tokens, heads, head_dim, generator=gen)
    whole = AttentionMetadata.build([(0, total, table)], block_size)
    write_kv(kc, vc, torch.randn(total, kv_heads, head_dim, generator=gen),
             torch.randn(total, kv_heads, head_dim, generator=gen), whole.slot_mapping)
    md = AttentionMetadata.build([(prefix, num_tokens, table)], block_size)
    names = ("DENSE_PREFILL_MIN_TOKENS", "DENSE_PREFILL_MIN_PAIRS", "DENSE_CHUNK_MIN_TOKENS",
             "DENSE_CHUNK_MIN_PREFIX")
    saved = [getattr(attention, n) for n in names]
    try:  # the engine's thresholds set aside: each path on every length
        for n, v in zip(names, (1 << 30, 0, 1 << 30, 0)):
            setattr(attention, n, v)
        paged_plan = attention.plan_attention(md, block_size)
        for n, v in zip(names, (1, 0, 1 << 30, 0)):
            setattr(attention, n, v)
        dense_plan = attention.plan_attention(md, block_size)
    finally:
        for n, v in zip(names, saved):
            setattr(attention, n, v)
    paged_ms = time_call_ms(lambda: attend(q, kc, vc, paged_plan), repeat)
    dense_ms = time_call_ms(lambda: attend(q, kc, vc, dense_plan), repeat)
    diff = (attend(q, kc, vc, paged_plan) - attend(q, kc, vc, dense_plan)).abs().max().item()
    return {"tokens": num_tokens, "prefix": prefix, "paged_ms": round(paged_ms, 3),
            "dense_ms": round(dense_ms, 3), "dense_over_paged": round(dense_ms / paged_ms, 3),
            "max_abs_diff": diff}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+",
                    default=[64, 128, 256, 512, 1024, 1920])
    ap.add_argument("--prefix", type=int, default=0,
                    help="cached tokens before the timed chunk")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--num-threads", type=int, default=1)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.num_threads)
    result: dict = {"args": vars(args)}
    report_environment(result)
    print(f"{args.heads} heads ({args.kv_heads} KV) of {args.head_dim}, block "
          f"{args.block_size}, {args.num_threads} thread(s), prefix {args.prefix}; "
          f"the engine takes the dense path from {attention.DENSE_PREFILL_MIN_TOKENS} tokens "
          f"and {attention.DENSE_PREFILL_MIN_PAIRS} (query, key) pairs, or from "
          f"{attention.DENSE_CHUNK_MIN_TOKENS} after {attention.DENSE_CHUNK_MIN_PREFIX} cached")
    print(f"{'tokens':>7} {'paged ms':>9} {'dense ms':>9} {'dense/paged':>12} {'max |diff|':>11}")
    rows = []
    for n in args.lengths:
        r = run_case(n, args.prefix, args.heads, args.kv_heads, args.head_dim,
                     args.block_size, args.repeat)
        rows.append(r)
        print(f"{n:>7} {r['paged_ms']:>9.3f} {r['dense_ms']:>9.3f} "
              f"{r['dense_over_paged']:>11.2f}x {r['max_abs_diff']:>11.1e}", flush=True)
    result["cases"] = rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
