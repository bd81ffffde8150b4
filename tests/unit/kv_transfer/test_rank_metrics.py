"""RankTransferMetrics over in-process WorkerServices: every rank's counters with its
``rank`` label, and a dead or hung rank left out of the scrape (bounded by the deadline)
and counted; GetTransferMetrics' wire form round-trips a snapshot."""
from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from xllm_py.kv_transfer import create_backend
from xllm_py.kv_transfer.kv_storage import KVCacheStorage
from xllm_py.kv_transfer.metrics import KVTransferMetrics
from xllm_py.kv_transfer.kv_worker import KVWorker
from xllm_py.rpc.worker_service import WorkerServicer, create_worker_server
from xllm_py.parallel.rank_metrics import RankTransferMetrics
from xllm_py.rpc import worker as wire
from xllm_py.utils.grpc_channels import ChannelPool
from xllm_py.utils.procs import free_port

pytestmark = pytest.mark.integration  # gRPC servers

TIMEOUT_S = 0.5


class HungServicer(WorkerServicer):
    async def GetTransferMetrics(self, request, context):
        await asyncio.sleep(30)


def _worker() -> KVWorker:
    store = KVCacheStorage(num_layers=1, num_blocks=4, block_size=4, num_kv_heads=1, head_dim=4)
    return KVWorker(store, create_backend("fake", store), cluster_id=1)


def _samples(registry: CollectorRegistry) -> dict:
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_snapshot_round_trips_the_wire() -> None:
    m = KVTransferMetrics()
    m.observe_success("pull", 1000, 2, 0.003)
    m.observe_success("push", 64, 1, 20.0)
    m.observe_failure("push", "timeout")
    snap = m.snapshot()
    assert wire.transfer_metrics_from_proto(wire.transfer_metrics_to_proto(snap)) == snap


def test_a_histogram_that_does_not_match_its_buckets_is_refused() -> None:
    msg = wire.transfer_metrics_to_proto(KVTransferMetrics(buckets=(0.1, 1.0)).snapshot())
    msg.ops.add(op="pull", bytes=8, blocks=1, bucket_counts=[1, 0], seconds_sum=0.05)
    with pytest.raises(ValueError, match="2 bucket counts for 2 buckets"):
        wire.transfer_metrics_from_proto(msg)


async def test_every_rank_with_its_label_and_a_dead_or_hung_rank_is_skipped_and_counted():
    workers = [_worker() for _ in range(3)]  # ranks 0 (local), 1 (live), 2 (hung)
    servers = []
    addrs = []
    for w, cls in ((workers[1], WorkerServicer), (workers[2], HungServicer)):
        server, port = await create_worker_server(cls(w), "127.0.0.1", 0)
        servers.append(server)
        addrs.append(f"127.0.0.1:{port}")
    addrs.append(f"127.0.0.1:{free_port()}")  # rank 3: nobody listens
    channels = ChannelPool()
    try:
        workers[0].metrics.observe_success("pull", 4096, 2, 0.004)
        workers[1].metrics.observe_success("pull", 8192, 2, 0.004)
        workers[1].metrics.observe_failure("pull", "timeout")
        workers[2].metrics.observe_success("pull", 1, 1, 0.004)
        ranks = RankTransferMetrics(workers[0].metrics, addrs, channels.get, timeout_s=TIMEOUT_S)
        registry = CollectorRegistry(auto_describe=True)
        registry.register(ranks)
        for scrape in (1, 2):
            t0 = time.monotonic()
            await ranks.refresh()
            assert time.monotonic() - t0 < TIMEOUT_S + 1.0  # one deadline, not one per rank
            got = _samples(registry)
            pulled = {k[1]: v for k, v in got.items() if k[0] == "xllm_kv_transfer_bytes_total"}
            assert pulled == {(("op", "pull"), ("rank", "0")): 4096,
                              (("op", "pull"), ("rank", "1")): 8192}
            assert got[("xllm_kv_transfer_failures_total",
                        (("op", "pull"), ("rank", "1"), ("reason", "timeout")))] == 1
            assert got[("xllm_kv_transfer_seconds_count", (("op", "pull"), ("rank", "1")))] == 1
            failures = {dict(k[1])["rank"]: v for k, v in got.items()
                        if k[0] == "xllm_kv_transfer_rank_scrape_failures_total"}
            assert failures == {"1": 0, "2": scrape, "3": scrape}
        # a rank that comes back is in the next scrape
        server, port = await create_worker_server(WorkerServicer(workers[2]), "127.0.0.1", 0)
        servers.append(server)
        ranks.rank_addrs[1] = f"127.0.0.1:{port}"
        await ranks.refresh()
        got = _samples(registry)
        assert got[("xllm_kv_transfer_bytes_total", (("op", "pull"), ("rank", "2")))] == 1
    finally:
        await channels.close()
        for s in servers:
            await s.stop(0)
        for w in workers:
            await w.backend.close()
