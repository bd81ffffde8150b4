"""rpc/cluster.py: InstanceMeta <-> InstanceMetaInfo and the heartbeat request."""
import pytest

from xllm_py.cluster.instance_meta import ROLE_NUMBERS, SCHEMA_VERSION, InstanceMetaError
from xllm_py.config import InstanceRole
from xllm_py.proto import xllm_pb2
from xllm_py.rpc import cluster as wire
from xllm_py.rpc import service

from tests.unit.cluster.test_instance_meta import make_meta


def test_proto_roundtrip_keeps_every_field():
    meta = make_meta()
    msg = wire.instance_meta_to_proto(meta)
    assert msg.type == xllm_pb2.DECODE
    assert list(msg.cluster_ids) == [11, 12]
    assert wire.instance_meta_from_proto(msg) == meta
    # Through the wire bytes too.
    assert wire.instance_meta_from_proto(xllm_pb2.InstanceMetaInfo.FromString(msg.SerializeToString())) == meta


def test_from_proto_defaults_for_old_writers():
    meta = wire.instance_meta_from_proto(xllm_pb2.InstanceMetaInfo(name="a:1", type=xllm_pb2.MIX))
    assert meta.type is InstanceRole.MIX
    assert meta.schema_version == SCHEMA_VERSION and meta.dp_size == 1 and meta.tp_size == 1
    with pytest.raises(InstanceMetaError):
        wire.instance_meta_from_proto(xllm_pb2.InstanceMetaInfo())


def test_heartbeat_roundtrip_through_the_service_reader():
    msg = wire.heartbeat_to_proto("a:1", "inc", 3, 2, 0.5, 40, 7, [b"s"], [b"r"], full_cache=True)
    hb = service.heartbeat_from_proto(xllm_pb2.HeartbeatRequest.FromString(msg.SerializeToString()))
    assert hb == service.Heartbeat(name="a:1", incarnation_id="inc", waiting=3, running=2,
                                   kv_usage=0.5, recent_max_ttft_ms=40, recent_max_tbt_ms=7,
                                   stored_cache=[b"s"], removed_cache=[b"r"], full_cache=True)
    assert wire.heartbeat_reply_from_proto(service.heartbeat_reply(False, "stale")) == (False, "stale")


def test_role_from_proto_rejects_unknown_numbers():
    assert wire.role_from_proto(xllm_pb2.PREFILL) is InstanceRole.PREFILL
    with pytest.raises(ValueError):
        wire.role_from_proto(99)


def test_instance_meta_reads_the_proto_role_numbers():
    """The JSON meta reads a role sent as a number without the wire layer: its table is
    the proto's enum."""
    assert ROLE_NUMBERS == {n: wire.role_from_proto(n) for n in xllm_pb2.InstanceType.values()}
