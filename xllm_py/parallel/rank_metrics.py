"""RankTransferMetrics: every tensor-parallel rank's KV transfer counters on rank 0's
/metrics (each rank has its own KV worker; ranks > 0 live in other processes).

Stages, per scrape: GET /metrics awaits ``refresh()`` (through
``AsyncEngine.refresh_metrics``) -> one WorkerService.GetTransferMetrics per rank > 0,
all at once, each under a deadline -> ``collect()`` renders rank 0's counters (read in
this process) and those of the ranks that answered, label ``rank``
(kv_transfer/metrics.py). A rank that does not answer in time (dead, hung, or an
unreadable reply) is left out of that scrape, never fails or holds it longer than the
deadline, and is counted in ``xllm_kv_transfer_rank_scrape_failures_total{rank}``.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable, Iterator, Sequence

import grpc
from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from xllm_py.kv_transfer.metrics import KVTransferMetrics, TransferSnapshot, transfer_families
from xllm_py.proto import xllm_pb2_grpc as pb_grpc
from xllm_py.rpc import worker as wire

logger = logging.getLogger(__name__)

# How long a scrape waits for a rank's counters (Prometheus's default scrape timeout is
# 10 s; the RPC is a copy of a few dozen numbers, a live rank answers in milliseconds).
SCRAPE_TIMEOUT_S = 2.0


class RankTransferMetrics(Collector):
    def __init__(self, local: KVTransferMetrics, rank_addrs: Sequence[str],
                 channel_for: Callable[[str], grpc.aio.Channel],
                 timeout_s: float = SCRAPE_TIMEOUT_S) -> None:
        """``local``: rank 0's counters; ``rank_addrs``: the WorkerService addresses of
        ranks 1..N-1, in rank order; ``channel_for``: a channel to an address (the
        engine's pool, with its TLS credentials)."""
        self.local = local
        self.rank_addrs = list(rank_addrs)
        self._channel_for = channel_for
        self.timeout_s = timeout_s
        self._remote: dict[int, TransferSnapshot] = {}
        self.num_failures = {rank: 0 for rank in range(1, len(self.rank_addrs) + 1)}

    async def refresh(self) -> None:
        """Fetch every rank > 0's counters (at most ``timeout_s``, whatever the ranks do)."""
        ranks = range(1, len(self.rank_addrs) + 1)
        snaps = await asyncio.gather(*(self._fetch(r) for r in ranks))
        self._remote = {r: s for r, s in zip(ranks, snaps) if s is not None}

    async def _fetch(self, rank: int) -> TransferSnapshot | None:
        addr = self.rank_addrs[rank - 1]
        stub = pb_grpc.WorkerServiceStub(self._channel_for(addr))
        try:
            reply = await stub.GetTransferMetrics(wire.transfer_metrics_request(),
                                                 timeout=self.timeout_s)
            return wire.transfer_metrics_from_proto(reply)
        except grpc.RpcError as exc:
            why = f"{exc.code().name}: {exc.details()}"
        except ValueError as exc:
            why = str(exc)
        self.num_failures[rank] += 1
        logger.warning("transfer metrics of tensor-parallel rank %d (%s) left out of this "
                       "scrape: %s", rank, addr, why)
        return None

    def collect(self) -> Iterator[Metric]:
        ranks = [(0, self.local.snapshot()), *sorted(self._remote.items())]
        yield from transfer_families(ranks)
        f = CounterMetricFamily(
            "xllm_kv_transfer_rank_scrape_failures",
            "Scrapes that left a tensor-parallel rank's KV transfer counters out (the rank "
            "did not answer GetTransferMetrics in time).", labels=["rank"])
        for rank, n in sorted(self.num_failures.items()):
            f.add_metric([str(rank)], n)
        yield f
