"""The PD code's gRPC clients: ``PDServiceClient`` calls other engines' DisaggPDService,
``GrpcWorkerClient`` one KV worker's WorkerService (a KVWorkerClient, kv_transfer/kv_worker.py).
Messages are built and read by xllm_py.rpc.pd; a failed call becomes a StatusError whose
message names the call and the gRPC code, as the client sees it."""
from __future__ import annotations

import grpc

from xllm_py.cluster.instance_meta import InstanceMeta
from xllm_py.pd_messages import HandOver, KVMove, OfflinePull, PeerLink, Placement
from xllm_py.proto import xllm_pb2_grpc as pb_grpc
from xllm_py.rpc import pd as wire
from xllm_py.rpc.convert import EngineRequestSpec
from xllm_py.status import Status, StatusError
from xllm_py.utils.grpc_channels import ChannelPool


class PDServiceClient:
    """The DisaggPDService RPCs of the PD code: to a decode (link_instance,
    add_new_request, first_generation) and to a prefill (send_pull_signal)."""

    def __init__(self, rpc_timeout_s: float,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        self.rpc_timeout_s = rpc_timeout_s
        self._channels = ChannelPool(credentials)

    def _pd(self, peer: InstanceMeta) -> pb_grpc.DisaggPDServiceStub:
        return pb_grpc.DisaggPDServiceStub(self._channels.get(peer.rpc_address))

    async def link_instance(self, decode: InstanceMeta, prefill: InstanceMeta) -> None:
        try:
            reply = await self._pd(decode).LinkInstance(wire.link_info_to_proto(prefill),
                                                        timeout=self.rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise StatusError(Status.FAILED_PRECONDITION, exc.details()) from None
            raise StatusError(Status.UNAVAILABLE, f"cannot link decode {decode.name}: "
                                                  f"{exc.code().name}") from None
        ok, message = wire.status_from_proto(reply)
        if not ok:
            raise StatusError(Status.UNAVAILABLE,
                              f"decode {decode.name} refused the link: {message}")

    async def add_new_request(self, decode: InstanceMeta, prefill: InstanceMeta,
                              spec: EngineRequestSpec) -> Placement:
        try:
            reply = await self._pd(decode).AddNewRequests(
                wire.add_requests_to_proto(prefill, [spec]), timeout=self.rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise _failed(exc, exc.code().name) from None
        return wire.placement_from_reply(reply, spec.request_id)

    async def first_generation(self, decode: InstanceMeta, handover: HandOver,
                               timeout_s: float) -> str:
        try:
            reply = await self._pd(decode).FirstGeneration(
                wire.handovers_to_proto([handover]), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise _failed(exc, exc.code().name) from None
        ok, message = wire.status_from_proto(reply)
        return "" if ok else (message or "decode refused the hand-over")

    async def send_pull_signal(self, prefill: InstanceMeta, pull: OfflinePull) -> int:
        try:
            reply = await self._pd(prefill).SendPullSignal(wire.offline_pull_to_proto(pull),
                                                           timeout=self.rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise _failed(exc, f"SendPullSignal to {prefill.name}: {exc.code().name}") from None
        ok, message, num_handed = wire.pull_reply_from_proto(reply)
        if not ok:
            raise StatusError(Status.UNAVAILABLE, f"prefill {prefill.name} refused the pull: "
                                                  f"{message}")
        return num_handed

    async def close(self) -> None:
        await self._channels.close()


class GrpcWorkerClient:
    """One KV worker of this instance (a TP rank > 0's, in its own process) over its
    WorkerService."""

    def __init__(self, worker_rpc_addr: str, rpc_timeout_s: float, transfer_timeout_s: float,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        self.worker_rpc_addr = worker_rpc_addr
        self.rpc_timeout_s = rpc_timeout_s
        self.transfer_timeout_s = transfer_timeout_s
        self._channels = ChannelPool(credentials)

    def _worker(self) -> pb_grpc.WorkerServiceStub:
        return pb_grpc.WorkerServiceStub(self._channels.get(self.worker_rpc_addr))

    async def push_kv(self, move: KVMove, heads: tuple[int, ...] | None = None) -> None:
        await self._transfer("push", self._worker().PushKVCache, wire.push_to_proto(move, heads))

    async def pull_kv(self, move: KVMove, heads: tuple[int, ...] | None = None) -> None:
        await self._transfer("pull", self._worker().PullKVCache, wire.pull_to_proto(move, heads))

    async def _transfer(self, op: str, rpc, msg) -> None:
        try:
            reply = await rpc(msg, timeout=self.transfer_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise StatusError(Status.BAD_GATEWAY, f"KV {op} failed: "
                                                  f"{exc.details() or exc.code().name}") from None
        ok, message = wire.status_from_proto(reply)
        if not ok:
            raise StatusError(Status.BAD_GATEWAY, f"KV {op} failed: {message}")

    async def link_cluster(self, link: PeerLink) -> None:
        try:
            reply = await self._worker().LinkCluster(wire.cluster_link_to_proto(link),
                                                     timeout=self.rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise StatusError(Status.FAILED_PRECONDITION, exc.details()) from None
            raise StatusError(Status.UNAVAILABLE,
                              f"worker link failed: {exc.code().name}") from None
        ok, message = wire.status_from_proto(reply)
        if not ok:
            raise StatusError(Status.UNAVAILABLE, f"worker link failed: {message}")

    async def close(self) -> None:
        await self._channels.close()


def _failed(exc: grpc.aio.AioRpcError, message: str) -> StatusError:
    return StatusError(Status.from_grpc(exc.code()), message)
