"""The service's HTTP probes and metrics: /health is liveness (200 with no engine at
all), /readiness says whether a request could be routed, /metrics carries the
service's series under their names."""
from __future__ import annotations

import weakref

import httpx
from prometheus_client.parser import text_string_to_metric_families

from xllm_py.api.app import build_app
from xllm_py.config import InstanceRole
from xllm_service.backend import ServiceBackend
from xllm_service.metrics import ServiceMetrics
from xllm_service.router import RoundRobinPolicy, Router
from xllm_service.sub_request import SubRequests
from tests.unit.service.test_service_relay import FakeEngines, info, register


class Tokenizer:
    eos_token_ids = [0]


def _backend(instances: list) -> ServiceBackend:
    subs = SubRequests()
    metrics = ServiceMetrics(subs.inflight_by_instance, lambda: [("m", 3)],
                             lambda: {"ACTIVE": len(instances), "SUSPECT": 0})
    router = Router(lambda role: [i for i in instances if i.role == role], RoundRobinPolicy())
    return ServiceBackend(Tokenizer(), "tiny", 2048, router, FakeEngines(), "127.0.0.1:0",
                          subs=subs, metrics=metrics)


_apps: "weakref.WeakKeyDictionary[ServiceBackend, object]" = weakref.WeakKeyDictionary()


async def _get(backend: ServiceBackend, path: str) -> httpx.Response:
    # one app per backend, as a process has (its metrics live in the backend's registry)
    if backend not in _apps:
        _apps[backend] = build_app(backend)
    app = _apps[backend]
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://svc") as client:
        return await client.get(path)


async def test_health_is_liveness_and_readiness_waits_for_an_instance():
    instances: list = []
    backend = _backend(instances)
    assert (await _get(backend, "/health")).status_code == 200
    r = await _get(backend, "/readiness")
    assert r.status_code == 503 and "no engine instance" in r.json()["reason"]
    instances.append(info("m", InstanceRole.MIX))
    assert (await _get(backend, "/readiness")).status_code == 200
    assert (await _get(backend, "/health")).status_code == 200


async def test_metrics_keep_their_names():
    instances = [info("m", InstanceRole.MIX)]
    backend = _backend(instances)
    register(backend, "r1", backend.router.route())
    backend.metrics.count_outcome({"m"}, "ok")
    backend.metrics.migrations["failed"] += 1
    text = (await _get(backend, "/metrics")).text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("xllm_service_requests_total", (("outcome", "ok"),))] == 1
    assert samples[("xllm_service_instance_requests_total",
                    (("instance", "m"), ("outcome", "ok")))] == 1
    assert samples[("xllm_service_migrations_total", (("outcome", "failed"),))] == 1
    assert samples[("xllm_service_migrations_total", (("outcome", "ok"),))] == 0
    assert samples[("xllm_service_inflight_requests", (("instance", "m"),))] == 1
    assert samples[("xllm_service_prefix_cached_blocks", (("instance", "m"),))] == 3
    assert samples[("xllm_service_instances", (("state", "ACTIVE"),))] == 1
    assert samples[("xllm_service_instances", (("state", "SUSPECT"),))] == 0
