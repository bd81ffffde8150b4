"""PDPeers: every RPC the PD code makes to another process, behind one small interface.

Prefill calls a decode engine's DisaggPDService (link_instance, add_new_request,
first_generation), a decode a prefill's (send_pull_signal); both sides call their own KV worker's WorkerService (push_kv,
pull_kv, link_cluster). A failure raises StatusError: the status of the failed call
(UNAVAILABLE, DEADLINE_EXCEEDED, FAILED_PRECONDITION for an incompatible peer, ...)
with a message for the client. The implementation is parallel/instance_peers.InstancePeers
(over gRPC and the engine's own KV worker); unit tests use a fake that runs in the test's
process.
"""
from __future__ import annotations

from typing import Protocol

from xllm_py.cluster.instance_meta import InstanceMeta
from xllm_py.pd_messages import HandOver, KVMove, OfflinePull, PeerLink, Placement
from xllm_py.rpc.convert import EngineRequestSpec


class PDPeers(Protocol):
    # ---- a decode engine (prefill calls these)
    async def link_instance(self, decode: InstanceMeta, prefill: InstanceMeta) -> None:
        """LinkInstance: decode's workers link prefill's (raises StatusError)."""

    async def add_new_request(self, decode: InstanceMeta, prefill: InstanceMeta,
                              spec: EngineRequestSpec) -> Placement:
        """AddNewRequests for one request (raises StatusError when the call fails)."""

    async def first_generation(self, decode: InstanceMeta, handover: HandOver,
                               timeout_s: float) -> str:
        """FirstGeneration: "" when decode took the request (or dropped it, if the
        hand-over says failed), else decode's problem (raises StatusError when the call
        fails)."""

    # ---- a prefill engine (decode calls it)
    async def send_pull_signal(self, prefill: InstanceMeta, pull: OfflinePull) -> int:
        """SendPullSignal: how many offline requests the prefill hands over (raises
        StatusError when the call fails)."""

    # ---- this instance's KV worker
    async def push_kv(self, move: KVMove) -> None:
        """PushKVCache (prefill, PUSH mode); raises StatusError(BAD_GATEWAY)."""

    async def pull_kv(self, move: KVMove) -> None:
        """PullKVCache (decode, PULL mode); raises StatusError(BAD_GATEWAY)."""

    async def link_cluster(self, link: PeerLink) -> None:
        """LinkCluster (decode, for a linking prefill); raises StatusError."""

    async def close(self) -> None: ...
