"""InstanceMeta: what an engine instance publishes about itself (xLLM's InstanceMetaInfo).

Wire forms: JSON (the etcd value under `XLLM:<ROLE>:<name>`) and the proto
`InstanceMetaInfo` (RegisterInstance / GetInstanceInfo / LinkInstance).

The JSON is versioned (`schema_version`) and parsed leniently: unknown keys are
ignored, missing optional keys take their defaults, and only a missing required key
(`name`, `type`) is an error. xLLM broke when the engine and the service drifted apart;
here a newer writer and an older reader still understand each other.
"""
from __future__ import annotations

import dataclasses
import json
import time
import uuid
from typing import Any

from xllm_py.config import InstanceRole
from xllm_py.kv_compat import kv_compat_differences
from xllm_py.proto import xllm_pb2

SCHEMA_VERSION = 1

_REQUIRED_KEYS = ("name", "type")



class InstanceMetaError(ValueError):
    """A registration value that cannot be understood (missing required key, bad JSON)."""


def new_incarnation_id() -> str:
    return uuid.uuid4().hex


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclasses.dataclass
class InstanceMeta:
    name: str                      # host:http_port
    type: InstanceRole = InstanceRole.DEFAULT
    rpc_address: str = ""          # DisaggPDService host:port
    cluster_ids: list[int] = dataclasses.field(default_factory=list)
    addrs: list[str] = dataclasses.field(default_factory=list)
    ports: list[int] = dataclasses.field(default_factory=list)
    dp_size: int = 1
    incarnation_id: str = ""
    register_ts_ms: int = 0
    kv_split_size: int = 1
    schema_version: int = SCHEMA_VERSION
    model: str = ""
    block_size: int = 0
    kv_layout: str = ""
    kv_dtype: str = ""
    tp_size: int = 1
    num_layers: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    num_blocks: int = 0
    http_address: str = ""
    worker_rpc_addrs: list[str] = dataclasses.field(default_factory=list)
    draining: bool = False  # shutting down: finishing what it runs, takes no new requests
    # Step costs for SLO_AWARE routing (xllm_py.cluster.latency_profile; JSON only, not in
    # the proto); empty: none registered.
    latency_profile: dict = dataclasses.field(default_factory=dict)
    # One per worker (with addrs): what a peer's transfer hello must carry (kv_transfer/base.py).
    # Secret: in etcd (TLS) and LinkInstance only, never in a repr or a log.
    transfer_keys: list[str] = dataclasses.field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if not self.name:
            raise InstanceMetaError("instance name must not be empty")
        if not isinstance(self.type, InstanceRole):
            self.type = InstanceRole.parse(str(self.type))

    @property
    def role(self) -> InstanceRole:
        return self.type

    # ------------------------------------------------------------------ JSON

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["type"] = self.type.value
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "InstanceMeta":
        if not isinstance(data, dict):
            raise InstanceMetaError(f"instance meta must be a JSON object, got {type(data).__name__}")
        missing = [k for k in _REQUIRED_KEYS if k not in data or data[k] in (None, "")]
        if missing:
            raise InstanceMetaError(f"instance meta is missing required key(s) {missing}")
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name not in data or data[f.name] is None:
                continue  # missing optional key -> default
            kwargs[f.name] = _coerce(f.name, data[f.name])
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as e:
            raise InstanceMetaError(f"bad instance meta for {data.get('name')!r}: {e}") from e

    @classmethod
    def from_json(cls, text: str | bytes) -> "InstanceMeta":
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise InstanceMetaError(f"instance meta is not valid JSON: {e}") from e
        return cls.from_dict(data)

    # ------------------------------------------------------------------ proto

    def to_proto(self) -> xllm_pb2.InstanceMetaInfo:
        return xllm_pb2.InstanceMetaInfo(
            name=self.name,
            rpc_address=self.rpc_address,
            type=xllm_pb2.InstanceType.Value(self.type.value),
            cluster_ids=self.cluster_ids,
            addrs=self.addrs,
            ports=self.ports,
            dp_size=self.dp_size,
            incarnation_id=self.incarnation_id,
            register_ts_ms=self.register_ts_ms,
            kv_split_size=self.kv_split_size,
            schema_version=self.schema_version,
            model=self.model,
            block_size=self.block_size,
            kv_layout=self.kv_layout,
            kv_dtype=self.kv_dtype,
            tp_size=self.tp_size,
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            num_blocks=self.num_blocks,
            http_address=self.http_address,
            worker_rpc_addrs=self.worker_rpc_addrs,
            draining=self.draining,
            transfer_keys=self.transfer_keys,
        )

    @classmethod
    def from_proto(cls, msg: xllm_pb2.InstanceMetaInfo) -> "InstanceMeta":
        if not msg.name:
            raise InstanceMetaError("InstanceMetaInfo.name must not be empty")
        return cls(
            name=msg.name,
            type=InstanceRole(xllm_pb2.InstanceType.Name(msg.type)),
            rpc_address=msg.rpc_address,
            cluster_ids=list(msg.cluster_ids),
            addrs=list(msg.addrs),
            ports=list(msg.ports),
            dp_size=msg.dp_size or 1,
            incarnation_id=msg.incarnation_id,
            register_ts_ms=msg.register_ts_ms,
            kv_split_size=msg.kv_split_size or 1,
            # proto3 has no presence: 0 means an old writer that predates versioning.
            schema_version=msg.schema_version or SCHEMA_VERSION,
            model=msg.model,
            block_size=msg.block_size,
            kv_layout=msg.kv_layout,
            kv_dtype=msg.kv_dtype,
            tp_size=msg.tp_size or 1,
            num_layers=msg.num_layers,
            num_kv_heads=msg.num_kv_heads,
            head_dim=msg.head_dim,
            num_blocks=msg.num_blocks,
            http_address=msg.http_address,
            worker_rpc_addrs=list(msg.worker_rpc_addrs),
            draining=msg.draining,
            transfer_keys=list(msg.transfer_keys),
        )

    # ------------------------------------------------------------------ peers

    def compatibility_problems(self, other: "InstanceMeta") -> list[str]:
        """Each difference that stops `self` and `other` from exchanging KV blocks
        (empty: compatible; unset fields are not compared)."""
        return [f"{field} differs: {self.name} has {mine!r}, {other.name} has {theirs!r}"
                for field, mine, theirs in kv_compat_differences(self, other)]

    def with_new_incarnation(self) -> "InstanceMeta":
        """A copy stamped for a fresh process start (new uuid, register time now)."""
        return dataclasses.replace(self, incarnation_id=new_incarnation_id(), register_ts_ms=now_ms())


_LIST_INT = {"cluster_ids", "ports"}
_LIST_STR = {"addrs", "worker_rpc_addrs", "transfer_keys"}
_INT = {
    "dp_size", "register_ts_ms", "kv_split_size", "schema_version", "block_size",
    "tp_size", "num_layers", "num_kv_heads", "head_dim", "num_blocks",
}


def _coerce(name: str, value: Any) -> Any:
    """JSON value -> field type; raises InstanceMetaError naming the field."""
    try:
        if name in _LIST_INT:
            return [int(v) for v in value]
        if name in _LIST_STR:
            return [str(v) for v in value]
        if name in _INT:
            return int(value)
        if name == "draining":
            if not isinstance(value, bool):
                raise ValueError("must be true or false")
            return value
        if name == "latency_profile":
            if not isinstance(value, dict):
                raise ValueError("must be a JSON object")
            return dict(value)
        if name == "type":
            if isinstance(value, int):  # a writer that sent the proto enum number
                return InstanceRole(xllm_pb2.InstanceType.Name(value))
            return InstanceRole.parse(str(value))
        return str(value)
    except (TypeError, ValueError) as e:
        raise InstanceMetaError(f"instance meta field {name!r} has a bad value {value!r}: {e}") from e
