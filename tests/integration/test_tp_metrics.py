"""A TP 2 instance's /metrics shows every rank's KV transfer counters (label ``rank``),
rank 1's fetched from its worker process over WorkerService.GetTransferMetrics: after PD
requests (service + PREFILL + DECODE processes, real etcd, tcp transfer) each rank's byte
counter equals the bytes of its own KV heads of every block handed over.
PULL, P TP 1 + D TP 2: decode's ranks pulled; PUSH, P TP 2 + D TP 1: prefill's pushed."""
from __future__ import annotations

import asyncio
import re

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.cluster_harness import Harness, client, wait_drained

pytestmark = pytest.mark.integration

BLOCK = 8
# tiny: 4 layers, head_dim 64, float32, 2 KV heads: one KV head of one block, K and V
HEAD_BLOCK_BYTES = 2 * 4 * BLOCK * 64 * 4
NUM_KV_HEADS = 2
PROMPTS = [[7 + i] * 3 + list(range(100 + 40 * i, 100 + 40 * i + n))
           for i, n in enumerate((5, 9, 23, 33))]  # distinct first tokens: no prefix hits
_TOOK = re.compile(r"PD decode took over request \S+ from \S+: (\d+) blocks")


def _rank_samples(url: str, name: str) -> dict[tuple[str, str], float]:
    """{(op, rank): value} of one labelled family on a process's /metrics."""
    text = httpx.get(url + "/metrics", timeout=10, trust_env=False).text
    return {(s.labels.get("op", ""), s.labels["rank"]): s.value
            for f in text_string_to_metric_families(text) for s in f.samples if s.name == name}


@pytest.mark.parametrize("mode,p_tp,d_tp", [("PULL", 1, 2), ("PUSH", 2, 1)])
def test_every_rank_reports_its_own_transfer_bytes(etcd_server, tmp_path, mode, p_tp, d_tp):
    h = Harness(etcd_server.endpoint, f"tp-metrics-{mode}/", tmp_path)
    common = ["--block-size", str(BLOCK), "--kv-cache-transfer-mode", mode,
              "--kv-transfer-backend", "tcp", "--num-blocks", "128"]
    try:
        svc, prefill, decode = h.pd_tp_cluster(common, p_tp, d_tp)
        c = client(svc)
        for prompt in PROMPTS:
            r = c.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0,
                                     extra_body={"ignore_eos": True})
            assert r.usage.completion_tokens == 3
        asyncio.run(wait_drained([prefill.http_url, decode.http_url], timeout_s=20))
        blocks = sum(int(b) for b in _TOOK.findall(decode.log_path.read_text(errors="replace")))
        assert blocks == sum((len(p) + BLOCK - 1) // BLOCK for p in PROMPTS)
        mover, tp, op = (decode, d_tp, "pull") if mode == "PULL" else (prefill, p_tp, "push")
        own = HEAD_BLOCK_BYTES * NUM_KV_HEADS // tp  # one rank's heads of one block
        moved = _rank_samples(mover.http_url, "xllm_kv_transfer_bytes_total")
        print(f"\n{mode} P TP {p_tp} + D TP {d_tp}: {blocks} blocks handed over; "
              f"{op} bytes per rank on /metrics {moved}")
        assert moved == {(op, str(r)): blocks * own for r in range(tp)}
        assert _rank_samples(mover.http_url, "xllm_kv_transfer_failures_total") == {}
        assert _rank_samples(mover.http_url, "xllm_kv_transfer_rank_scrape_failures_total") \
            == {("", "1"): 0}
        # the other side moved nothing itself (TP 1: rank 0 only, as before)
        other = prefill if mover is decode else decode
        assert _rank_samples(other.http_url, "xllm_kv_transfer_bytes_total") == {}
    finally:
        h.stop()
