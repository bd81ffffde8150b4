"""What the PD code says to a peer, as plain dataclasses (the wire forms are built and
read in xllm_py/rpc/pd.py only).

  LinkInstance      -> the linking prefill's InstanceMeta   (decode reads a PeerLink)
  AddNewRequests    -> EngineRequestSpec                     <- Placement
  FirstGeneration   -> HandOver                              <- "" or decode's problem
  PullKVCache / PushKVCache on our worker -> KVMove
  SendPullSignal (decode -> prefill) -> OfflinePull        <- requests handed (int)
"""
from __future__ import annotations

import dataclasses

from xllm_py.cluster.instance_meta import InstanceMeta
from xllm_py.outputs import TokenLogprob
from xllm_py.status import Status


@dataclasses.dataclass
class OfflinePull:
    """A decode with room asks a prefill for offline work (PullSignal): up to
    `preferred_req_len` requests whose prompt + max_tokens together fit `max_total_len`
    tokens, placed on `source_instance_name`."""
    source_instance_name: str
    preferred_req_len: int
    max_total_len: int


@dataclasses.dataclass
class Placement:
    """Decode's answer to AddNewRequests for one request. OK: the blocks it set aside
    that prefill must fill (prompt positions from num_cached_tokens on);
    RESOURCE_EXHAUSTED: no KV space now; anything else: refused (message says why)."""
    request_id: str
    status: Status
    block_ids: list[int] = dataclasses.field(default_factory=list)
    num_cached_tokens: int = 0
    message: str = ""


@dataclasses.dataclass
class HandOver:
    """FirstGeneration for one request: prefill's first token (with its logprobs) and
    where prefill's KV is (PULL: decode's worker pulls `block_ids` from `addrs[0]`), or
    `failed` (decode drops the blocks it set aside; `status_msg` says why)."""
    request_id: str
    prefill_name: str = ""
    mode: str = ""  # "PULL" | "PUSH" (the KV is already in decode's blocks); "": PULL
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprob | None] = dataclasses.field(default_factory=list)
    cluster_ids: list[int] = dataclasses.field(default_factory=list)
    addrs: list[str] = dataclasses.field(default_factory=list)
    worker_rpc_addrs: list[str] = dataclasses.field(default_factory=list)
    block_ids: list[int] = dataclasses.field(default_factory=list)
    dp_size: int = 1
    num_computed_tokens: int = 0
    failed: bool = False
    status_msg: str = ""


@dataclasses.dataclass
class KVMove:
    """One KV transfer run by this instance's worker: `src_blocks` of the side that has
    the KV into `dst_blocks` of the other; `addr`/`cluster_id` name the peer's worker,
    `transfer_key` its key (empty: known from the link)."""
    request_id: str
    cluster_id: int
    addr: str
    src_blocks: list[int]
    dst_blocks: list[int]
    transfer_key: str = dataclasses.field(default="", repr=False)
    # per KV group in order, how many of the blocks are its (hybrid models; () = not
    # known, refused where pipeline stages move each group's layers apart:
    # instance_peers.py)
    group_blocks: tuple[int, ...] = ()


@dataclasses.dataclass
class PeerLink:
    """LinkInstance as decode reads it: the prefill's transfer endpoints, which decode's
    worker links (LinkCluster), and its meta (None from a sender that predates it)."""
    instance_name: str
    cluster_ids: list[int]
    addrs: list[str]
    meta: InstanceMeta | None = None
