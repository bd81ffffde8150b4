"""KV pull bandwidth between two processes, next to memcpy and a plain TCP socket.

    python benchmarks/bench_kv_transfer.py [--backend ucx|tcp] [--sizes-mb 1 4 16 64 256]
                                           [--repeat 5] [--mode auto|iov|direct|gather] [--no-map] [--json]
                                           [--keyed] [--heads N]

A peer process (``xllm_py.kv_transfer._peer_main``) owns the source pool; this process
pulls ``size`` bytes of blocks into its own pool through the backend, for a contiguous
block list (one run) and a fragmented one (every other source block, shuffled, into
shuffled destinations: no two blocks adjacent). Baselines measured in the same run with
the same bytes: ``numpy.copyto`` in-process (memcpy) and a plain Python TCP socket between
two processes (``sendall`` / ``recv_into`` a preallocated buffer). Bandwidths are GB/s
(1e9 bytes per second), best of ``--repeat`` after one warm-up.

With ucx both pools are allocated as engines in a PD role allocate theirs (UCX shared
memory), so the puller maps the peer's pool and a pull is a memcpy (column ``path``:
mapped); ``--no-map`` (private pools) or ``--mode iov`` measure UCX's message path instead.

``--keyed``: the same pulls again from a peer that requires a transfer key (as every engine's
worker does, kv_transfer/base.py), linked with that key; prints both bandwidths, their ratio
and the time of each link. The key is checked once per connection (in the hello); the data
path is the same, and cluster TLS covers the gRPC that links and starts transfers, not the
KV bytes.

``--hybrid-kv`` (instead of the above, its own flags: benchmarks/hybrid_kv_handover.py):
the bytes a PD hand-over of a Gemma 3 prompt moves (``xllm_kv_transfer_bytes_total``) and
the long prompts one decode pool holds, before and after the sliding-window layers got
blocks of their own (engine/hybrid_kv.py).

``--stream`` (instead of the above, its own flags: benchmarks/kv_stream_handover.py): a PD
hand-over's time after the first token and TTFT, bulk vs streamed during a chunked
prefill (engine/pd/kv_stream.py), at prompt lengths, interleaved.

``--heads N``: the same pulls again as KV head slices, as a decode rank of another TP
reads them: a second puller whose pool holds N of the peer's 8 heads pulls heads
``[0, N)`` of the same source blocks (kv_transfer/ucx/slices.py: per (kv, layer) of each
block, ``block_size`` rows of ``N * head_dim`` elements). Prints the slice pull's time
and bandwidth next to the whole-block pull's, and the time ratio (the slice moves N/8 of
the bytes).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import struct
import sys
import time

import numpy as np

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import report_environment  # noqa: E402

# Geometry: float16, 4 layers, 16 slots, 8 heads x 64 dims -> 16 KiB per (kv, layer) slice, 128 KiB per block.
GEOM = dict(num_layers=4, block_size=16, num_kv_heads=8, head_dim=64, dtype="float16")


def _socket_server(port_q: "mp.Queue", max_bytes: int) -> None:
    buf = np.full(max_bytes, 7, dtype=np.uint8)
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(1)
    port_q.put(ls.getsockname()[1])
    conn, _ = ls.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    mv = memoryview(buf)
    while True:
        head = conn.recv(8, socket.MSG_WAITALL)
        if len(head) < 8:
            return
        (n,) = struct.unpack("!Q", head)
        conn.sendall(mv[:n])


def bench_socket(sizes: list[int], repeat: int) -> dict[int, float]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_socket_server, args=(q, max(sizes)), daemon=True)
    p.start()
    out: dict[int, float] = {}
    try:
        s = socket.create_connection(("127.0.0.1", q.get(timeout=60)))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        dst = np.empty(max(sizes), dtype=np.uint8)
        for n in sizes:
            mv = memoryview(dst)[:n]
            best = float("inf")
            for i in range(repeat + 1):
                t = time.perf_counter()
                s.sendall(struct.pack("!Q", n))
                got = 0
                while got < n:
                    k = s.recv_into(mv[got:], n - got)
                    if k == 0:
                        raise ConnectionError("socket baseline server closed")
                    got += k
                if i:
                    best = min(best, time.perf_counter() - t)
            out[n] = n / best / 1e9
        s.close()
    finally:
        p.join(5)
        if p.is_alive():
            p.terminate()
    return out


def bench_memcpy(n: int, repeat: int) -> float:
    a = np.full(n, 3, dtype=np.uint8)
    b = np.empty_like(a)
    best = float("inf")
    for i in range(repeat + 1):
        t = time.perf_counter()
        np.copyto(b, a)
        if i:
            best = min(best, time.perf_counter() - t)
    return n / best / 1e9


async def _best_pull(backend, addr: str, src, dst, repeat: int, heads=None) -> tuple[float, int, set]:
    """(best seconds, bytes, paths) of ``repeat`` pulls after one warm-up."""
    best, nbytes, paths = float("inf"), 0, set()
    for i in range(repeat + 1):
        r = await backend.pull(addr, src, dst, heads=heads)
        nbytes = r.num_bytes
        paths.add(r.path or backend.name)
        if i:
            best = min(best, r.seconds)
    return best, nbytes, paths


async def bench_backend(args: argparse.Namespace, sizes: list[int],
                        key: str | None = None) -> tuple[list[dict], dict]:
    import torch

    from xllm_py.config import TransferConfig
    from xllm_py.kv_transfer import KVCacheStorage, create_backend
    from xllm_py.kv_transfer._peer_main import peer_process
    from xllm_py.kv_transfer.factory import mappable_host_allocator
    from xllm_py.kv_transfer.ucx.env import iov_worker_config, ucx_env

    probe = KVCacheStorage(num_blocks=2, **GEOM)
    block_bytes = probe.block_bytes
    max_blocks = max(sizes) // block_bytes
    peer_blocks = 2 * max_blocks  # room for "every other block"
    mappable = args.backend == "ucx" and args.mode == "auto" and not args.no_map
    flags = ["--backend", args.backend, "--no-fill"] + ([] if mappable else ["--private-pool"])
    flags += ["--access-key", key] if key else []
    with peer_process(*flags, **{**GEOM, "num_blocks": peer_blocks}) as (_, info):
        store = KVCacheStorage(num_blocks=max_blocks, **GEOM,
                               allocator=mappable_host_allocator() if mappable else None)
        store.kv.view(torch.uint8).reshape(-1)[::4096] = 1  # fault the pages in
        kwargs = {"mode": args.mode} if args.backend == "ucx" else {}
        backend = create_backend(args.backend, store, TransferConfig(timeout_s=120), **kwargs)
        backend.start()
        sliced = None  # a puller holding args.heads of the peer's heads (another TP)
        if args.heads:
            sstore = KVCacheStorage(num_blocks=max_blocks, **{**GEOM, "num_kv_heads": args.heads},
                                    allocator=mappable_host_allocator() if mappable else None)
            sstore.kv.view(torch.uint8).reshape(-1)[::4096] = 1
            sliced = create_backend(args.backend, sstore, TransferConfig(timeout_s=120), **kwargs)
            sliced.start()
        rng = np.random.default_rng(0)
        rows = []
        try:
            t0 = time.perf_counter()
            await backend.link(info["transfer_addr"], key=key or "")
            link_ms = (time.perf_counter() - t0) * 1e3
            if sliced is not None:
                await sliced.link(info["transfer_addr"], key=key or "")
            for size in sizes:
                n = size // block_bytes
                for fragmented in (False, True):
                    if fragmented:
                        src = rng.permutation(np.arange(0, 2 * n, 2))
                        dst = rng.permutation(n)
                    else:
                        src, dst = np.arange(n), np.arange(n)
                    best, nbytes, paths = await _best_pull(backend, info["transfer_addr"], src, dst, args.repeat)
                    rows.append({"bytes": nbytes, "blocks": n, "fragmented": fragmented, "link_ms": link_ms,
                                 "gbps": nbytes / best / 1e9, "ms": best * 1e3, "path": "+".join(sorted(paths))})
                    if sliced is not None:
                        sbest, sbytes, spaths = await _best_pull(sliced, info["transfer_addr"], src, dst,
                                                                 args.repeat, heads=(0, 0, args.heads))
                        rows[-1].update(slice_bytes=sbytes, slice_ms=sbest * 1e3, slice_gbps=sbytes / sbest / 1e9,
                                        slice_vs_whole_time=sbest / best, slice_path="+".join(sorted(spaths)))
        finally:
            await backend.close()
            if sliced is not None:
                await sliced.close()
        env = ucx_env() if args.backend == "ucx" else {}
        if args.backend == "ucx" and args.mode in ("auto", "iov"):
            env.update({f"iov-context:{k}": v for k, v in iov_worker_config().items()})
        return rows, env


def main() -> None:
    if "--hybrid-kv" in sys.argv[1:]:
        from benchmarks.hybrid_kv_handover import main as hybrid_kv

        sys.exit(hybrid_kv([a for a in sys.argv[1:] if a != "--hybrid-kv"]))
    if "--stream" in sys.argv[1:]:
        from benchmarks.kv_stream_handover import main as stream

        sys.exit(stream([a for a in sys.argv[1:] if a != "--stream"]))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=["ucx", "tcp"], default="ucx")
    p.add_argument("--sizes-mb", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--mode", choices=["auto", "iov", "direct", "gather"], default="auto",
                   help="ucx data path (auto = a mapped peer pool on host memory when possible, else iov)")
    p.add_argument("--no-map", action="store_true",
                   help="ucx: private (torch) pools on both sides, so the iov message path runs (not the mapped one)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--keyed", action="store_true",
                   help="also pull from a peer that requires a transfer key; report the ratio")
    p.add_argument("--heads", type=int, default=0, metavar="N",
                   help=f"also pull heads [0, N) of the same blocks (of {GEOM['num_kv_heads']}) into a pool of N "
                        "heads (instances of different TP); report slice vs whole-block times")
    p.add_argument("--hybrid-kv", action="store_true",
                   help="instead: a Gemma 3 hand-over's bytes and a decode's capacity before and "
                        "after the hybrid KV layout (its flags: --hybrid-kv --help)")
    p.add_argument("--stream", action="store_true",
                   help="instead: a PD hand-over after the first token and TTFT, bulk vs the "
                        "KV streamed during a chunked prefill (its flags: --stream --help)")
    args = p.parse_args()
    if args.heads and not 0 < args.heads < GEOM["num_kv_heads"]:
        p.error(f"--heads must be in [1, {GEOM['num_kv_heads']})")
    if args.backend == "ucx":
        from xllm_py.kv_transfer.ucx.env import apply_ucx_env_defaults
        apply_ucx_env_defaults()  # so that the peer process inherits the same settings

    sizes = [mb << 20 for mb in args.sizes_mb]
    rows, env = asyncio.run(bench_backend(args, sizes))
    keyed = asyncio.run(bench_backend(args, sizes, key="bench-transfer-key"))[0] if args.keyed else []
    for r, k in zip(rows, keyed):
        r["keyed_gbps"], r["keyed_link_ms"] = k["gbps"], k["link_ms"]
        r["keyed_vs_plain"] = k["gbps"] / r["gbps"]
    sock = bench_socket(sorted({r["bytes"] for r in rows}), args.repeat)
    for r in rows:
        r["socket_gbps"] = sock[r["bytes"]]
        r["memcpy_gbps"] = bench_memcpy(r["bytes"], args.repeat)
        r["pct_of_memcpy"] = 100.0 * r["gbps"] / r["memcpy_gbps"]
    result = {"backend": args.backend, "mode": args.mode, "geometry": GEOM, "rows": rows, "ucx_env": env,
              "cpus": os.cpu_count(), "heads": args.heads}
    report_environment(result, file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(result))
        return
    print(f"backend={args.backend} mode={args.mode} geometry={GEOM}")
    print(f"{'MB':>6} {'frag':>5} {'blocks':>6} {'ms':>8} {'GB/s':>6} {'socket':>7} {'memcpy':>7} {'%memcpy':>8} path")
    for r in rows:
        print(f"{r['bytes'] / 2**20:>6.0f} {str(r['fragmented']):>5} {r['blocks']:>6} {r['ms']:>8.2f} "
              f"{r['gbps']:>6.2f} {r['socket_gbps']:>7.2f} {r['memcpy_gbps']:>7.2f} {r['pct_of_memcpy']:>7.0f}% {r['path']}")
    if args.heads:
        print(f"head slices: heads [0, {args.heads}) of {GEOM['num_kv_heads']} of the same blocks, into a pool "
              f"of {args.heads} heads")
        print(f"{'MB':>6} {'frag':>5} {'slice MB':>8} {'ms':>8} {'GB/s':>6} {'whole ms':>8} {'time ratio':>10} path")
        for r in rows:
            print(f"{r['bytes'] / 2**20:>6.0f} {str(r['fragmented']):>5} {r['slice_bytes'] / 2**20:>8.2f} "
                  f"{r['slice_ms']:>8.2f} {r['slice_gbps']:>6.2f} {r['ms']:>8.2f} {r['slice_vs_whole_time']:>10.2f} "
                  f"{r['slice_path']}")
    if keyed:
        print(f"keyed peer (transfer key in the hello): link {rows[0]['keyed_link_ms']:.1f} ms vs "
              f"{rows[0]['link_ms']:.1f} ms plain")
        for r in rows:
            print(f"{r['bytes'] / 2**20:>6.0f} {str(r['fragmented']):>5} keyed {r['keyed_gbps']:>6.2f} GB/s "
                  f"vs plain {r['gbps']:>6.2f} GB/s: {r['keyed_vs_plain']:.3f}x")
    if env:
        print("UCX settings: " + " ".join(f"{k}={v}" for k, v in sorted(env.items())))


if __name__ == "__main__":
    main()
