"""Cluster TLS: etcd and gRPC servers answer only callers holding a certificate of the
cluster CA (mutual TLS); plaintext callers and certificates of another CA are refused."""
from __future__ import annotations

import grpc
import pytest

from xllm_py.cluster.certs import make_cluster_certs
from xllm_py.cluster.etcd_client import EtcdClient, EtcdError
from xllm_py.cluster.etcd_server import EmbeddedEtcd
from xllm_py.proto import xllm_pb2, xllm_pb2_grpc
from xllm_py.tls import TLSConfig, channel_credentials, server_credentials
from xllm_py.utils.grpc_channels import open_channel
from xllm_py.utils.grpc_server import start_grpc_server

pytestmark = pytest.mark.integration


def _tls(issued) -> TLSConfig:
    return TLSConfig(cert=issued.cert, key=issued.key, ca=issued.ca)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    cluster = make_cluster_certs(tmp_path_factory.mktemp("cluster"), names=("etcd", "service", "engine"))
    outsider = make_cluster_certs(tmp_path_factory.mktemp("outsider"), names=("engine",))
    return {name: _tls(i) for name, i in cluster.items()} | {"outsider": _tls(outsider["engine"])}


def test_tls_config_needs_all_three_flags(certs) -> None:
    assert TLSConfig.from_args(None, None, None) is None
    with pytest.raises(ValueError, match="missing --tls-key, --tls-ca"):
        TLSConfig.from_args(certs["engine"].cert, None, None)
    with pytest.raises(ValueError, match="no such file"):
        TLSConfig.from_args("/nonexistent.pem", certs["engine"].key, certs["engine"].ca)


async def test_etcd_over_mutual_tls_answers_only_cluster_members(certs) -> None:
    with EmbeddedEtcd(tls=certs["etcd"]) as etcd:
        member = EtcdClient(etcd.endpoint, namespace="t/", tls=certs["service"])
        await member.connect()
        try:
            await member.put("k", b"v")
            assert (await member.get("k")).value == b"v"
        finally:
            await member.close()
        for tls in (None, certs["outsider"]):  # plaintext, and a certificate of another CA
            stranger = EtcdClient(etcd.endpoint, namespace="t/", tls=tls, timeout_s=1.0)
            with pytest.raises(EtcdError):
                await stranger.connect()
                await stranger.get("k")
            await stranger.close()


class _CacheInfo(xllm_pb2_grpc.WorkerServiceServicer):
    async def GetCacheInfo(self, request, context):
        return xllm_pb2.CacheInfo(cluster_id=7)


async def test_grpc_server_with_mutual_tls_refuses_callers_without_a_cluster_certificate(certs) -> None:
    server, port = await start_grpc_server(xllm_pb2_grpc.add_WorkerServiceServicer_to_server, _CacheInfo(),
                                           "127.0.0.1", 0, "test", server_credentials(certs["engine"]))
    addr = f"127.0.0.1:{port}"
    try:
        channel = open_channel(addr, channel_credentials(certs["service"]))
        reply = await xllm_pb2_grpc.WorkerServiceStub(channel).GetCacheInfo(xllm_pb2.Empty(), timeout=5)
        assert reply.cluster_id == 7
        await channel.close()
        for creds in (None, channel_credentials(certs["outsider"])):
            channel = open_channel(addr, creds)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await xllm_pb2_grpc.WorkerServiceStub(channel).GetCacheInfo(xllm_pb2.Empty(), timeout=3)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            await channel.close()
    finally:
        await server.stop(0)
