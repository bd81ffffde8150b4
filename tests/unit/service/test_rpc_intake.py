"""The gRPC intake checks on their own: what a FirstGeneration must carry to
be decoded, which heartbeats and registrations the service refuses."""
from __future__ import annotations

import pytest

from xllm_py.cluster.instance_meta import InstanceMeta
from xllm_py.config import InstanceRole
from xllm_py.engine.pd.decode import handover_problem
from xllm_py.pd_messages import HandOver
from xllm_py.outputs import TokenLogprob
from xllm_py.rpc.service import Heartbeat, heartbeat_problem
from xllm_service.rpc_service import registration_problem

VOCAB = 1000


def _handover(**kw) -> HandOver:
    fields = dict(request_id="r", prefill_name="p", mode="PULL", token_ids=[5], logprobs=[None],
                  cluster_ids=[0], addrs=["127.0.0.1:7"], worker_rpc_addrs=[], block_ids=[3, 4],
                  dp_size=1, num_computed_tokens=0, failed=False, status_msg="")
    fields.update(kw)
    return HandOver(**fields)


def test_a_good_handover_passes():
    assert handover_problem(_handover(), 2, VOCAB) == ""
    assert handover_problem(_handover(mode="PUSH", block_ids=[], addrs=[]), 2, VOCAB) == ""
    assert handover_problem(_handover(block_ids=[], addrs=[]), 0, VOCAB) == ""


@pytest.mark.parametrize("kw, words", [
    (dict(token_ids=[]), "0 first tokens"),
    (dict(token_ids=[1, 2], logprobs=[None, None]), "2 first tokens"),
    (dict(token_ids=[VOCAB]), f"token id {VOCAB} is out of range"),
    (dict(token_ids=[-1]), "token id -1 is out of range"),
    (dict(logprobs=[TokenLogprob(5, -0.1, [(10 ** 6, -1.0)])]), "out of range"),
    (dict(logprobs=[TokenLogprob(5, float("nan"), [])]), "NaN"),
    (dict(mode="SIDEWAYS"), "unknown kv_cache_transfer_mode"),
    (dict(block_ids=[3]), "prefill sent 1 blocks, decode expects 2"),
    (dict(block_ids=[3, -4]), "block ids must be >= 0"),
    (dict(addrs=[]), "no transfer address"),
])
def test_a_handover_that_cannot_be_decoded_says_why(kw, words):
    assert words in handover_problem(_handover(**kw), 2, VOCAB)


def _hb(**kw) -> Heartbeat:
    fields = dict(name="e:1", incarnation_id="i", waiting=1, running=2, kv_usage=0.5,
                  recent_max_ttft_ms=3, recent_max_tbt_ms=4, stored_cache=[], removed_cache=[],
                  full_cache=False)
    fields.update(kw)
    return Heartbeat(**fields)


@pytest.mark.parametrize("kw", [dict(name=""), dict(incarnation_id=""), dict(waiting=-1),
                                dict(recent_max_tbt_ms=-5), dict(kv_usage=float("nan")),
                                dict(kv_usage=1.5), dict(kv_usage=float("inf")),
                                dict(stored_cache=[b"x"] * (1 << 16 + 1))])
def test_impossible_heartbeats_are_refused(kw):
    assert heartbeat_problem(_hb()) == ""
    assert heartbeat_problem(_hb(**kw))


@pytest.mark.parametrize("kw, words", [
    (dict(rpc_address=""), "rpc_address"), (dict(rpc_address="nowhere"), "rpc_address"),
    (dict(rpc_address="h:99999"), "rpc_address"), (dict(dp_size=-1), "dp_size"),
    (dict(num_blocks=-3), "num_blocks"), (dict(cluster_ids=[1, 2], addrs=["a:1"]), "differ"),
    (dict(name="x" * 300), "at most"),
])
def test_registrations_that_cannot_be_real_are_refused(kw, words):
    good = dict(name="e:1", type=InstanceRole.MIX, rpc_address="127.0.0.1:9", block_size=16)
    assert registration_problem(InstanceMeta(**good)) == ""
    assert registration_problem(InstanceMeta(**{**good, "rpc_address": "[::1]:80"})) == ""
    assert words in registration_problem(InstanceMeta(**{**good, **kw}))
