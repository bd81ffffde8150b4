"""PrefixIndex: which prefix-cache blocks each engine holds, from its heartbeats'
`cache_event` (block hashes stored / removed since the previous heartbeat).

The hashes are the engines' own chain (`block_pool.hash_block_tokens`: a block's hash
covers every token before it), so the service finds how many leading blocks of a prompt
an instance has cached by hashing the prompt's full blocks and walking them in order.
Engines send a full snapshot (`full`) to a new master, after a failed heartbeat and every
30 s, so events lost with a heartbeat, or held by a previous master, skew it only until
then; it is a routing hint either way, never a reason a request fails.

Below the pools (engine/kv_tiering.py): an engine writes every block its pool caches
through to its KV tiers, so a block an instance's pool let go is still on that instance's
host memory or disk, and in the shared store where it has one. The index keeps those
(`_fallen`, bounded, newest kept) and `tier_matches` continues a prompt's match there:
its own tiers first, then what any instance of the same store ever held. The tiers evict
without telling: such a count may be high, and the engine then computes what it lacks.
"""
from __future__ import annotations

import collections
from typing import Sequence

from xllm_py.engine.block_pool import hash_block_tokens
from xllm_py.engine.cache_events import hash_from_bytes


def prompt_block_hashes(prompt_token_ids: Sequence[int], block_size: int) -> list[int]:
    """The hash chain of the prompt's full blocks, as an engine with `block_size` makes it."""
    hashes: list[int] = []
    for start in range(0, len(prompt_token_ids) - block_size + 1, block_size):
        hashes.append(hash_block_tokens(hashes[-1] if hashes else None,
                                        prompt_token_ids[start:start + block_size]))
    return hashes


def tiers_of(info) -> dict:
    """An instance's registered KV tiers (InstanceMeta.kv_tiers), {} when none."""
    return info.meta.kv_tiers if isinstance(info.meta.kv_tiers, dict) else {}


def load_ms(info, below: dict[str, int]) -> float:
    """What loading `below` (tier_matches' counts) costs `info`, by its registered
    per-block costs: its own tiers at its host memory's (else its disk's) cost."""
    tiers = tiers_of(info)
    cost = tiers.get("load_ms_per_block") or {}
    local = cost.get("host", cost.get("disk", 0.0))
    return below.get("local", 0) * float(local) + below.get("store", 0) * float(cost.get("store", 0.0))


# Hashes kept per instance once its pool let them go (blocks in its KV tiers).
FALLEN_MAX = 1 << 18


class PrefixIndex:
    def __init__(self, fallen_max: int = FALLEN_MAX) -> None:
        self._blocks: dict[str, set[int]] = collections.defaultdict(set)
        self._fallen: dict[str, collections.OrderedDict[int, None]] = collections.defaultdict(
            collections.OrderedDict)
        self.fallen_max = fallen_max
        self._scope: dict[str, str] = {}  # instance -> its store's scope (kv_tiers)

    def update(self, name: str, stored: Sequence[bytes], removed: Sequence[bytes],
               full: bool = False) -> None:
        """Registry.on_cache_event callback."""
        stored_h = {hash_from_bytes(b) for b in stored}
        if full:
            gone = self._blocks.get(name, set()) - stored_h
            self._blocks[name] = stored_h
        else:
            gone = {hash_from_bytes(b) for b in removed}
            blocks = self._blocks[name]
            blocks.difference_update(gone)
            blocks.update(stored_h)
        fallen = self._fallen[name]
        for h in stored_h:
            fallen.pop(h, None)
        for h in gone:
            fallen[h] = None
            fallen.move_to_end(h)
        while len(fallen) > self.fallen_max:
            fallen.popitem(last=False)

    def forget(self, name: str) -> None:
        self._blocks.pop(name, None)
        self._fallen.pop(name, None)
        self._scope.pop(name, None)

    def matched(self, info, hashes: Sequence[int]) -> tuple[int, dict[str, int]]:
        """(blocks of `hashes` in `info`'s pool, {"local", "store"}: those after them that
        its KV tiers hold, tier_matches)."""
        pool = self.matched_blocks(info.name, hashes)
        tiers = tiers_of(info)
        have = tiers.get("tiers") or ()
        scope = tiers.get("store_scope") or ""
        if scope and "store" in have:
            self._scope[info.name] = scope
        local = "host" in have or "disk" in have
        peers = [n for n, sc in self._scope.items() if sc == scope] if scope and "store" in have else []
        if not (local or peers) or pool >= len(hashes):
            return pool, {}
        return pool, self.tier_matches(info.name, hashes, pool, local, peers)

    def tier_matches(self, name: str, hashes: Sequence[int], start: int, local: bool,
                     store_peers: Sequence[str]) -> dict[str, int]:
        """How many of `hashes` from `start` on (past what `name`'s pool holds) `name` finds
        below its pool, in order: {"local": in its own tiers (when it has host memory or
        disk: `local`), "store": in the store it shares with `store_peers` (their pools and
        what fell from them; empty: no store)}."""
        fallen = self._fallen.get(name, {})
        peers = [(self._blocks.get(p, ()), self._fallen.get(p, {})) for p in store_peers]
        out = {"local": 0, "store": 0}
        for h in hashes[start:]:
            if local and h in fallen:
                out["local"] += 1
            elif any(h in pool or h in gone for pool, gone in peers):
                out["store"] += 1
            else:
                break
        return out

    def sizes(self) -> list[tuple[str, int]]:
        """(instance, cached blocks), by name."""
        return sorted((name, len(blocks)) for name, blocks in self._blocks.items())

    def num_cached_blocks(self, name: str) -> int:
        return len(self._blocks.get(name, ()))

    def matched_blocks(self, name: str, hashes: Sequence[int]) -> int:
        """How many of `hashes` (a prompt's chain), from the first, `name` holds."""
        blocks = self._blocks.get(name)
        if not blocks:
            return 0
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n
