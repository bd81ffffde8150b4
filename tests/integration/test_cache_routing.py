"""Cache-aware routing end to end: two MIX engines report their prefix-cache blocks in
heartbeats; the service (--load-balance-policy CACHE_AWARE) sends each prompt to the
engine that holds its prefix, where least-load routing would send every request of an
idle cluster to the same engine."""
from __future__ import annotations

import re
import time

import httpx
import pytest

from tests.integration.cluster_harness import Harness, client, metric

pytestmark = pytest.mark.integration

BLOCK = 16
FAMILY_X = list(range(100, 164))  # 4 full blocks
FAMILY_Y = list(range(300, 364))


def _complete(proc, prompt: list[int]) -> None:
    out = client(proc).completions.create(model="tiny", prompt=prompt, max_tokens=2,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 2


def _served(svc, name: str) -> int:
    text = httpx.get(svc.http_url + "/metrics", timeout=5, trust_env=False).text
    m = re.search(rf'xllm_service_instance_requests_total{{instance="{name}",outcome="ok"}} (\d+)',
                  text)
    return int(m.group(1)) if m else 0


def _cached_blocks(svc, name: str) -> int:
    text = httpx.get(svc.http_url + "/metrics", timeout=5, trust_env=False).text
    m = re.search(rf'xllm_service_prefix_cached_blocks{{instance="{name}"}} (\d+)', text)
    return int(m.group(1)) if m else 0


def test_requests_go_to_the_engine_holding_their_prefix(etcd_server, tmp_path):
    h = Harness(etcd_server.endpoint, "cache-route/", tmp_path)
    try:
        svc = h.service(extra=["--load-balance-policy", "CACHE_AWARE"])
        engines = [h.engine("MIX", f"mix-{i}", extra=["--block-size", str(BLOCK)])
                   for i in range(2)]
        for e in engines:
            e.wait_ready(180)
        svc.wait_ready(60, path="/readiness")
        names = [e.http_url.removeprefix("http://") for e in engines]
        first, second = sorted(zip(names, engines))  # least-load ties go to `first`
        # Warm each engine directly with one family; their heartbeats tell the service.
        _complete(second[1], FAMILY_X + [1])
        _complete(first[1], FAMILY_Y + [1])
        deadline = time.monotonic() + 10
        while not all(_cached_blocks(svc, n) >= 4 for n in names):
            assert time.monotonic() < deadline, "cache events did not reach the service"
            time.sleep(0.1)
        hits_before = [metric(e.http_url, "xllm_prefix_cache_hit_tokens_total")
                       for _, e in (first, second)]
        for i in range(3):
            _complete(svc, FAMILY_X + [10 + i, 11])
            _complete(svc, FAMILY_Y + [10 + i, 11])
        assert _served(svc, second[0]) == 3 and _served(svc, first[0]) == 3
        hits = [metric(e.http_url, "xllm_prefix_cache_hit_tokens_total") - before
                for (_, e), before in zip((first, second), hits_before)]
        assert hits == [3 * 64, 3 * 64]  # every routed request reused its 4 cached blocks
    finally:
        h.stop()
