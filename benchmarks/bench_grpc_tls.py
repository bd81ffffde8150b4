"""The cost of cluster TLS on one gRPC hop: the same unary RPC (WorkerService.GetCacheInfo,
a small reply) and the same PipelinedStream round trip the service uses for Generate, over
a plaintext port and a mutual-TLS port of one server process, calls interleaved; plus the
time to open a channel (TCP + the TLS handshake) each way.

    python benchmarks/bench_grpc_tls.py [--calls 2000] [--json]

Both ports are served in a child process (so client and server do not share an event
loop); certificates from xllm_py.cluster.certs.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import pathlib
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import report_environment  # noqa: E402
from xllm_py.cluster.certs import make_cluster_certs  # noqa: E402
from xllm_py.proto import xllm_pb2 as pb  # noqa: E402
from xllm_py.proto import xllm_pb2_grpc as pb_grpc  # noqa: E402
from xllm_py.tls import TLSConfig, channel_credentials, server_credentials  # noqa: E402
from xllm_py.utils.grpc_channels import PipelinedStream, open_channel  # noqa: E402
from xllm_py.utils.grpc_server import start_grpc_server  # noqa: E402


class _Servicer(pb_grpc.WorkerServiceServicer, pb_grpc.DisaggPDServiceServicer):
    async def GetCacheInfo(self, request, context):
        return pb.CacheInfo(cluster_id=1, addr="127.0.0.1:1", num_blocks=1024, block_size=16)

    async def GenerateStream(self, request_iterator, context):
        async for _ in request_iterator:
            yield pb.Status(ok=True, code=200)


def _serve(tls: TLSConfig, q: "mp.Queue") -> None:
    async def main() -> None:
        servicer = _Servicer()
        ports, servers = [], []  # (a server nobody holds is collected and stops)
        for creds in (None, server_credentials(tls)):
            server, port = await start_grpc_server(
                lambda s, srv: (pb_grpc.add_WorkerServiceServicer_to_server(s, srv),
                                pb_grpc.add_DisaggPDServiceServicer_to_server(s, srv)),
                servicer, "127.0.0.1", 0, "bench", credentials=creds)
            ports.append(port)
            servers.append(server)
        q.put(ports)
        await asyncio.Event().wait()

    asyncio.run(main())


async def _measure(ports: list[int], tls: TLSConfig, calls: int) -> dict:
    creds = {"plain": None, "tls": channel_credentials(tls)}
    addr = {"plain": f"127.0.0.1:{ports[0]}", "tls": f"127.0.0.1:{ports[1]}"}
    connect: dict[str, list[float]] = {k: [] for k in creds}
    for _ in range(20):  # channel open: TCP (+ TLS handshake) + first call
        for k in creds:
            t0 = time.perf_counter()
            async with open_channel(addr[k], creds[k]) as ch:
                await pb_grpc.WorkerServiceStub(ch).GetCacheInfo(pb.Empty(), timeout=10)
            connect[k].append((time.perf_counter() - t0) * 1e3)
    unary: dict[str, list[float]] = {k: [] for k in creds}
    stream: dict[str, list[float]] = {k: [] for k in creds}
    channels = {k: open_channel(addr[k], creds[k]) for k in creds}
    stubs = {k: pb_grpc.WorkerServiceStub(channels[k]) for k in creds}
    streams = {k: PipelinedStream(pb_grpc.DisaggPDServiceStub(channels[k]).GenerateStream)
               for k in creds}
    msg = pb.DisaggRequest(service_req_id="bench", prompt_tokens=list(range(64)))
    try:
        for i in range(calls + 100):  # the first 100 warm up
            for k in creds:
                t0 = time.perf_counter()
                await stubs[k].GetCacheInfo(pb.Empty(), timeout=10)
                t1 = time.perf_counter()
                await streams[k].request(msg, 10)
                t2 = time.perf_counter()
                if i >= 100:
                    unary[k].append((t1 - t0) * 1e3)
                    stream[k].append((t2 - t1) * 1e3)
    finally:
        for k in creds:
            await streams[k].close()
            await channels[k].close()
    out: dict = {"calls": calls}
    for what, data in (("connect", connect), ("unary", unary), ("stream", stream)):
        for k in creds:
            out[f"{what}_{k}_p50_ms"] = statistics.median(data[k])
        out[f"{what}_tls_vs_plain"] = out[f"{what}_tls_p50_ms"] / out[f"{what}_plain_p50_ms"]
        out[f"{what}_tls_cost_ms"] = out[f"{what}_tls_p50_ms"] - out[f"{what}_plain_p50_ms"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    issued = make_cluster_certs(tempfile.mkdtemp(prefix="bench-tls-"), ("server", "client"))
    server_tls = TLSConfig(issued["server"].cert, issued["server"].key, issued["server"].ca)
    client_tls = TLSConfig(issued["client"].cert, issued["client"].key, issued["client"].ca)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_serve, args=(server_tls, q), daemon=True)
    proc.start()
    try:
        result = asyncio.run(_measure(q.get(timeout=60), client_tls, args.calls))
    finally:
        proc.kill()
    report_environment(result, file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(result))
        return 0
    for what, label in (("connect", "open a channel + first call"), ("unary", "unary GetCacheInfo"),
                        ("stream", "PipelinedStream round trip (64 token ids)")):
        print(f"{label:>42}: plain {result[f'{what}_plain_p50_ms']:.3f} ms, mutual TLS "
              f"{result[f'{what}_tls_p50_ms']:.3f} ms p50: {result[f'{what}_tls_cost_ms']:+.3f} ms "
              f"({result[f'{what}_tls_vs_plain']:.2f}x)")
    print(f"({args.calls} calls each, interleaved; connect: 20 each)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
