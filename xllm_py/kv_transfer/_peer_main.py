"""A stand-alone KV worker process for tests and benchmarks.

``python -m xllm_py.kv_transfer._peer_main --backend ucx --num-blocks 64 --seed 7``
allocates a storage filled with ``fill_pattern(seed)``, serves the WorkerService (gRPC)
and the transfer listener, prints one JSON line ``{"grpc_port", "transfer_addr",
"cluster_id"}`` on stdout, and runs until stdin closes or it is killed. ``peer_process``
runs it from a test or benchmark.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import subprocess
import sys
from collections.abc import Iterator

import torch

from xllm_py.config import TransferConfig, child_env
from xllm_py.kv_transfer.factory import create_backend, mappable_host_allocator
from xllm_py.kv_transfer.kv_storage import KVCacheStorage
from xllm_py.kv_transfer.kv_worker import KVWorker
from xllm_py.rpc.worker_service import WorkerServicer, create_worker_server
from xllm_py.utils.cli import enable_crash_stacks

logger = logging.getLogger(__name__)

MODULE = "xllm_py.kv_transfer._peer_main"


def fill_pattern(storage: KVCacheStorage, seed: int) -> None:
    """Deterministic content, reproducible in another process."""
    g = torch.Generator().manual_seed(seed)
    storage.kv.copy_(torch.randn(storage.kv.shape, generator=g).to(storage.kv))


@contextlib.contextmanager
def peer_process(*flags: str, **geometry: object) -> Iterator[tuple[subprocess.Popen, dict]]:
    """This module in a child process with ``flags`` and the storage ``geometry``
    (``num_blocks=64`` -> ``--num-blocks=64``). Yields (process, its JSON line); on exit
    closes its stdin (it shuts down), waits, and kills it after 10 s. A test may kill it
    first."""
    cmd = [sys.executable, "-m", MODULE, *flags]
    cmd += [f"--{k.replace('_', '-')}={v}" for k, v in geometry.items()]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=child_env(PYTHONUNBUFFERED="1"))
    try:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"peer process failed to start (rc={proc.wait(10)})")
        yield proc, json.loads(line)
    finally:
        if proc.poll() is None:
            proc.stdin.close()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--backend", default="ucx")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--transfer-listen-port", type=int, default=0)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--num-blocks", type=int, default=64)
    p.add_argument("--block-size", type=int, default=4)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=8)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--model", default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cluster-id", type=int, default=1)
    p.add_argument("--no-fill", action="store_true", help="leave the cache zeroed (faster start for big pools)")
    p.add_argument("--access-key", default=None,
                   help="serve only requesters whose hello carries this transfer key (as engines do)")
    p.add_argument("--private-pool", action="store_true",
                   help="a plain torch pool even with the ucx backend (peers cannot map it: the iov path)")
    return p


async def main_async(args: argparse.Namespace) -> None:
    mappable = args.backend == "ucx" and not args.private_pool
    storage = KVCacheStorage(args.num_layers, args.num_blocks, args.block_size, args.num_kv_heads,
                             args.head_dim, args.dtype,
                             allocator=mappable_host_allocator() if mappable else None)
    if not args.no_fill:
        fill_pattern(storage, args.seed)
    else:
        storage.kv.view(torch.uint8).reshape(-1)[::4096] = 7  # touch the pages
    cfg = TransferConfig(backend=args.backend, listen_host=args.host, listen_port=args.transfer_listen_port)
    backend = create_backend(args.backend, storage, cfg, access_key=args.access_key)
    addr = backend.start()
    worker = KVWorker(storage, backend, args.cluster_id, model=args.model)
    server, port = await create_worker_server(WorkerServicer(worker), args.host, 0)
    print(json.dumps({"grpc_port": port, "transfer_addr": addr, "cluster_id": args.cluster_id}), flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)  # until the parent closes our stdin
    await server.stop(0.5)
    await backend.close()


def main() -> None:
    enable_crash_stacks()  # a native crash prints every thread's Python stack
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    asyncio.run(main_async(build_parser().parse_args()))


if __name__ == "__main__":
    main()
