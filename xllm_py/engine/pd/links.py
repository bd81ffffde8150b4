"""Links: which peer instances this one is linked with for KV transfer.

Prefill stages, per decode: listed by the master (prelink, every
`prelink_interval_s`) or chosen for a request -> compatibility checked against our
meta (refused once per incarnation: FAILED_PRECONDITION) -> LinkInstance (decode's
workers run LinkCluster to ours) -> linked until it leaves the master's list, a call
to it fails, or a new incarnation of it appears (linked afresh).
Decode stages, per prefill: LinkInstance arrives -> compatibility checked -> our worker
runs LinkCluster -> linked until UnlinkInstance.
The two directions are kept apart: an elastic instance (duty.py) does both, and that
another instance linked us (it reads our KV) says nothing of whether we linked it.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from xllm_py.cluster.instance_meta import InstanceMeta
from xllm_py.pd_messages import PeerLink
from xllm_py.engine.pd.peers import PDPeers
from xllm_py.status import Status, StatusError

logger = logging.getLogger(__name__)

# Resolves an instance name to its published meta (etcd), or None.
MetaResolver = Callable[[str], Awaitable[InstanceMeta | None]]
# Names of the schedulable decode instances (from the master).
DecodeLister = Callable[[], Awaitable[list[str]]]


class Links:
    def __init__(self, meta: InstanceMeta, peers: PDPeers, resolve_meta: MetaResolver | None,
                 list_decodes: DecodeLister | None,
                 forget_meta: Callable[[str], None] | None = None) -> None:
        self.meta = meta
        self.peers = peers
        self.resolve_meta = resolve_meta
        self.forget_meta = forget_meta
        self.list_decodes = list_decodes
        self._linked: dict[str, InstanceMeta] = {}  # decodes we linked (prefill side)
        self._linked_by: dict[str, InstanceMeta] = {}  # prefills that linked us (decode side)
        self._refused: set[tuple[str, str]] = set()  # (decode, incarnation) incompatible

    def __len__(self) -> int:
        return len(self._linked.keys() | self._linked_by.keys())

    def __contains__(self, name: str) -> bool:
        return name in self._linked or name in self._linked_by

    def forget(self, name: str) -> None:
        """Link `name` afresh next time (it left, failed a call, or unlinked)."""
        self._linked.pop(name, None)
        self._linked_by.pop(name, None)

    # ------------------------------------------------------------------ prefill
    async def link(self, decode: InstanceMeta) -> None:
        """Link `decode` unless this incarnation of it is linked; raises StatusError
        (FAILED_PRECONDITION: incompatible, no point retrying this pair)."""
        linked = self._linked.get(decode.name)
        if linked is not None and linked.incarnation_id == decode.incarnation_id:
            return
        problems = self.meta.compatibility_problems(decode)
        if problems:
            raise StatusError(Status.FAILED_PRECONDITION,
                              f"decode {decode.name} is incompatible: " + "; ".join(problems))
        await self.peers.link_instance(decode, self.meta)
        self._linked[decode.name] = decode

    async def link_current(self, decode: InstanceMeta) -> InstanceMeta:
        """Link `decode` and return the meta linked: when linking fails, its meta is read
        again past any cache and, if it moved (an instance restarted under its name
        listens elsewhere), linked once more; raises StatusError as `link`."""
        try:
            await self.link(decode)
            return decode
        except StatusError as exc:
            if exc.status is Status.FAILED_PRECONDITION:  # incompatible: no point retrying
                raise
            fresh = await self._fresh_meta(decode.name)
            if fresh is None or (fresh.rpc_address == decode.rpc_address
                                 and fresh.incarnation_id == decode.incarnation_id):
                raise
        await self.link(fresh)
        return fresh

    async def _fresh_meta(self, name: str) -> InstanceMeta | None:
        """`name`'s meta read again past any cache."""
        if self.forget_meta is not None:
            self.forget_meta(name)
        return await self.resolve_meta(name) if self.resolve_meta is not None else None

    async def prelink_loop(self, interval_s: float) -> None:
        while True:
            try:
                await self.prelink_once()
            except Exception:  # never stop linking for one bad round
                logger.exception("prelink round failed")
            await asyncio.sleep(interval_s)

    async def prelink_once(self) -> list[str]:
        """Link the decodes the master lists that are not linked yet (new, or a new
        incarnation), before a request needs them: the link (LinkInstance, the decode
        workers' LinkCluster: UCX endpoints, mapping this pool on the same host) otherwise
        lands on the first request's TTFT. Returns the names linked now."""
        try:
            names = await self.list_decodes()
        except Exception as exc:  # no master yet, or switching over: next round
            logger.debug("prelink: could not list decode instances: %s", exc)
            return []
        if names:  # (none listed: maybe no master right now; keep what is linked)
            for gone in set(self._linked) - set(names):  # left, or draining: relink if back
                del self._linked[gone]
        linked = []
        for name in names:
            if name == self.meta.name:  # (elastic: listed as a decode itself)
                continue
            try:
                meta = await self.resolve_meta(name)
            except Exception as exc:  # etcd down and never seen: next round
                logger.debug("prelink: no meta for %s: %s", name, exc)
                continue
            if meta is None or (name, meta.incarnation_id) in self._refused:
                continue
            known = self._linked.get(name)
            if known is not None and known.incarnation_id == meta.incarnation_id:
                continue
            try:
                await self.link(meta)
            except StatusError as exc:
                if exc.status is Status.FAILED_PRECONDITION:  # say it once per incarnation
                    self._refused.add((name, meta.incarnation_id))
                    logger.warning("prelink: %s", exc.message)
                else:
                    logger.debug("prelink: %s", exc.message)
                continue
            linked.append(name)
            logger.info("linked decode %s ahead of requests", name)
        return linked

    # ------------------------------------------------------------------ decode
    async def link_instance(self, link: PeerLink) -> None:
        """A prefill links on first contact: our worker links its workers. Raises
        StatusError (FAILED_PRECONDITION: incompatible)."""
        peer = link.meta
        if peer is not None:
            problems = self.meta.compatibility_problems(peer)
            if problems:
                raise StatusError(Status.FAILED_PRECONDITION,
                                  f"prefill {peer.name} is incompatible: " + "; ".join(problems))
        await self.peers.link_cluster(link)
        if peer is not None:
            self._linked_by[peer.name] = peer
