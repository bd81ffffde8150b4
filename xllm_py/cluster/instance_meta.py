"""InstanceMeta: what an engine instance publishes about itself (xLLM's InstanceMetaInfo).

Wire forms: JSON (the etcd value under `XLLM:<ROLE>:<name>`) and the proto
`InstanceMetaInfo` (RegisterInstance / GetInstanceInfo / LinkInstance; built and read
in xllm_py/rpc/cluster.py).

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
from xllm_py.model.kv_layout import (KVLayout, RankKV, TransferPlanError, kv_layout,
                                     transfer_plan)

SCHEMA_VERSION = 1

_REQUIRED_KEYS = ("name", "type")
# xLLM's InstanceType numbers (protos/xllm.proto), for a writer that sent the number in the
# JSON; test_rpc_cluster.py holds them equal to the proto's.
ROLE_NUMBERS = {0: InstanceRole.DEFAULT, 1: InstanceRole.PREFILL, 2: InstanceRole.DECODE,
                3: InstanceRole.MIX}


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
    # The KV tiers below its pool (engine/kv_tiering.py `describe`; JSON only): "tiers"
    # (host, disk, store), "store_scope" (instances with the same one share the store's
    # blocks), "load_ms_per_block" per tier; empty: none.
    kv_tiers: dict = dataclasses.field(default_factory=dict)
    # One per worker (with addrs): what a peer's transfer hello must carry (kv_transfer/base.py).
    # Secret: in etcd (TLS) and LinkInstance only, never in a repr or a log.
    transfer_keys: list[str] = dataclasses.field(default_factory=list, repr=False)
    pp_size: int = 1
    # One per rank, pp_rank * tp + tp_rank (a PD instance's addrs list the same workers
    # in process order: kv_layout.worker_rank):
    # [layer_start, layer_end, head_start, head_end), the model layers and KV heads its
    # pool holds (model/kv_layout.py); empty from a writer that predates it: then every
    # rank holds every layer and its TP share of the heads.
    rank_kv: list[list[int]] = dataclasses.field(default_factory=list)
    # Elastic (a MIX started in a cluster: it takes the duty the master assigns,
    # cluster/role_assignment.py): `duty` is the assignment it acknowledged ("": none
    # yet, MIX) and `duty_epoch` that assignment's epoch. JSON only.
    elastic: bool = False
    duty: str = ""
    duty_epoch: int = 0

    def __post_init__(self) -> None:
        if not self.name:
            raise InstanceMetaError("instance name must not be empty")
        if not isinstance(self.type, InstanceRole):
            self.type = InstanceRole.parse(str(self.type))

    @property
    def role(self) -> InstanceRole:
        return self.type

    @property
    def serving_role(self) -> InstanceRole:
        """The role it serves now: an elastic instance's acknowledged duty, else its type."""
        if self.elastic and self.duty:
            return InstanceRole.parse(self.duty)
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

    # ------------------------------------------------------------------ peers

    def compatibility_problems(self, other: "InstanceMeta") -> list[str]:
        """Each difference that stops `self` and `other` from exchanging KV blocks
        (empty: compatible; unset fields are not compared)."""
        problems = [f"{field} differs: {self.name} has {mine!r}, {other.name} has {theirs!r}"
                    for field, mine, theirs in kv_compat_differences(self, other)]
        if not problems and self.num_kv_heads and other.num_kv_heads:
            p, d = (other, self) if self.type is InstanceRole.DECODE else (self, other)
            try:  # each rank holds some layers and KV heads: the decode's must be planned
                transfer_plan(*pair_layouts(p, d))
            except TransferPlanError as e:
                problems.append(f"KV layouts: prefill {p.name} (TP {p.tp_size} x PP "
                                f"{p.pp_size}), decode {d.name} (TP {d.tp_size} x PP "
                                f"{d.pp_size}): {e}")
        return problems

    def rank_layout(self, registered: bool = True) -> KVLayout:
        """What each rank holds, as registered; from a writer without ``rank_kv`` (or
        ``registered`` False, unless pipeline stages split the layers), every layer
        (counted as the pool's) and the rank's TP share of the KV heads."""
        if not self.rank_kv or (not registered and self.pp_size == 1):
            try:
                return kv_layout(max(self.num_layers, 1), self.num_kv_heads, self.tp_size,
                                 model=self.model)
            except TransferPlanError as e:
                raise TransferPlanError(f"instance {self.name}: {e}") from e
        ranks = tuple(RankKV((s[0], s[1]), (s[2], s[3])) for s in self.rank_kv)
        return KVLayout(max(r.layers[1] for r in ranks), self.num_kv_heads, self.tp_size,
                        self.pp_size, ranks, self.model)

    def with_new_incarnation(self) -> "InstanceMeta":
        """A copy stamped for a fresh process start (new uuid, register time now)."""
        return dataclasses.replace(self, incarnation_id=new_incarnation_id(), register_ts_ms=now_ms())


def pair_layouts(prefill: InstanceMeta, decode: InstanceMeta) -> tuple[KVLayout, KVLayout]:
    """The two sides' layouts for their transfer plan: as registered when both registered
    them, else both as a writer without ``rank_kv`` sees them (the layer counts then are
    the pools', comparable on both sides)."""
    both = bool(prefill.rank_kv) and bool(decode.rank_kv)
    return prefill.rank_layout(both), decode.rank_layout(both)


_LIST_INT = {"cluster_ids", "ports"}
_LIST_STR = {"addrs", "worker_rpc_addrs", "transfer_keys"}
_INT = {
    "dp_size", "pp_size", "register_ts_ms", "kv_split_size", "schema_version", "block_size",
    "tp_size", "num_layers", "num_kv_heads", "head_dim", "num_blocks", "duty_epoch",
}


def _coerce(name: str, value: Any) -> Any:
    """JSON value -> field type; raises InstanceMetaError naming the field."""
    try:
        if name in _LIST_INT:
            return [int(v) for v in value]
        if name == "rank_kv":
            spans = [[int(v) for v in span] for span in value]
            if any(len(span) != 4 for span in spans):
                raise ValueError("each rank's span must be 4 integers")
            return spans
        if name in _LIST_STR:
            return [str(v) for v in value]
        if name in _INT:
            return int(value)
        if name in ("draining", "elastic"):
            if not isinstance(value, bool):
                raise ValueError("must be true or false")
            return value
        if name in ("latency_profile", "kv_tiers"):
            if not isinstance(value, dict):
                raise ValueError("must be a JSON object")
            return dict(value)
        if name == "type":
            if isinstance(value, int):  # a writer that sent the proto enum number
                if value not in ROLE_NUMBERS:
                    raise ValueError(f"unknown InstanceType number {value}")
                return ROLE_NUMBERS[value]
            return InstanceRole.parse(str(value))
        return str(value)
    except (TypeError, ValueError) as e:
        raise InstanceMetaError(f"instance meta field {name!r} has a bad value {value!r}: {e}") from e
