"""rpc/worker.py: the WorkerService requests as the worker reads them, read back from
what the engine side (rpc/pd.py) builds."""
from __future__ import annotations

import pytest

from xllm_py.cluster.instance_meta import InstanceMeta
from xllm_py.config import InstanceRole
from xllm_py.pd_messages import KVMove, PeerLink
from xllm_py.kv_transfer.kv_worker import CacheInfoData, PeerMeta
from xllm_py.proto import xllm_pb2 as pb
from xllm_py.rpc import pd
from xllm_py.rpc import worker as wire


def test_pull_and_push_read_back():
    move = KVMove("r1", 7, "10.0.0.1:5", [1, 2], [3, 4], transfer_key="secret-key")
    for msg in (pd.pull_to_proto(move), pd.push_to_proto(move)):
        t = wire.transfer_from_proto(type(msg).FromString(msg.SerializeToString()))
        assert t == wire.WorkerTransfer("10.0.0.1:5", [1, 2], [3, 4], "r1", "secret-key")
        assert "secret-key" not in repr(t)


def test_a_layer_range_without_heads_is_refused():
    for fields in ({"num_layers": 2}, {"src_layer_start": 1}, {"dst_layer_start": 1}):
        for msg in (pb.PullKVCacheRequest(src_blocks=[1], dst_blocks=[1], **fields),
                    pb.PushKVCacheRequest(src_blocks=[1], dst_blocks=[1], **fields)):
            with pytest.raises(ValueError, match="layer range .* needs num_heads"):
                wire.transfer_from_proto(msg)


def test_link_with_and_without_meta():
    meta = InstanceMeta(name="p:1", type=InstanceRole.PREFILL, model="m", block_size=16,
                        kv_dtype="float16", num_layers=2, num_kv_heads=4, head_dim=8,
                        transfer_keys=["k1", "k2"])
    link = wire.link_from_proto(pd.cluster_link_to_proto(
        PeerLink("p:1", cluster_ids=[1, 2], addrs=["a:1", "a:2"], meta=meta)))
    assert (link.cluster_ids, link.addrs, link.keys) == ([1, 2], ["a:1", "a:2"], ["k1", "k2"])
    assert link.peer_meta == PeerMeta("m", 16, "float16", "", 2, 4, 8)
    bare = wire.link_from_proto(pb.ClusterLink(cluster_ids=[1], addrs=["a:1"]))
    assert bare == wire.WorkerLink([1], ["a:1"], None, [])


def test_replies():
    assert wire.ok_to_proto() == pb.Status(ok=True, code=200)
    info = CacheInfoData(7, "a:1", 32, 16, 2, 4, 8, "float16", "kv,layer", 4096)
    msg = wire.cache_info_to_proto(info)
    assert (msg.cluster_id, msg.num_blocks, msg.kv_layout, msg.block_bytes) == (7, 32, "kv,layer", 4096)
