"""KVCacheManager: allocate and free a request's KV blocks, with prefix-cache hits.

Per request:
    get_computed_blocks (prefix hits, at admission) -> allocate_slots (each step;
    None = cannot now) -> cache_full_blocks (as blocks fill with computed KV) -> free.

The block table lives on `Request.block_ids`; the hash chain of its full blocks on
`Request.block_hashes`.

KV tiers (engine/kv_tiering.py): with `enable_offload`, each block this manager caches
(a full-attention group's, as it fills; a sliding group's, only the window a later hit
ending where the request ended would read, when the request is freed) is logged with a
reference held, so it cannot be reused before the engine copied it out
(`take_offloads`, then `release_offloads`). A prefix found in the tiers is loaded into
blocks the first allocation sets aside for it (`tier_loads`). Hybrid models (sliding-window and full-attention layers):
HybridKVCacheManager (hybrid_kv.py), a table per KV group. Pure Python: no torch, no grpc.
"""
from __future__ import annotations

import logging

from xllm_py.engine.block_pool import BlockPool, hash_block_tokens
from xllm_py.request import Request

logger = logging.getLogger(__name__)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    group_windows: tuple[int, ...] = (0,)

    def __init__(self, block_pool: BlockPool) -> None:
        self.block_pool = block_pool
        self.block_size = block_pool.block_size
        self._requests: dict[str, Request] = {}  # requests that hold blocks
        self._num_cached_blocks: dict[str, int] = {}  # leading blocks already hashed
        # (block id, group, chain hash) of cached blocks to copy to the tiers, each holding
        # one reference; None: no tiers
        self._offloads: list[tuple[int, int, int]] | None = None
        self._offload_refs: dict[int, int] = {}  # block id -> references logged, not released

    # -- KV tiers ------------------------------------------------------------------------
    def enable_offload(self) -> None:
        if self._offloads is None:
            self._offloads = []

    def take_offloads(self) -> list[tuple[int, int, int]]:
        """The blocks logged since the last call; each still holds its reference until
        `release_offloads`."""
        items, self._offloads = self._offloads or [], [] if self._offloads is not None else None
        return items

    def release_offloads(self, items: list[tuple[int, int, int]]) -> None:
        held = self._offload_refs
        for block_id, _, _ in items:
            if held[block_id] > 1:
                held[block_id] -= 1
            else:
                del held[block_id]
        self.block_pool.free_blocks(block_id for block_id, _, _ in items)

    def num_held_for_offload(self) -> int:
        """Blocks no live request references, held only until the engine copied them to the
        tiers (any thread: a snapshot)."""
        pool = self.block_pool
        return sum(1 for b, n in list(self._offload_refs.items()) if pool.ref_count(b) <= n)

    def _log_offload(self, block_id: int, group: int, chain_hash: int) -> None:
        self.block_pool.touch((block_id,))
        self._offload_refs[block_id] = self._offload_refs.get(block_id, 0) + 1
        self._offloads.append((block_id, group, chain_hash))

    def first_kept_block(self, group: int, first_pos: int) -> int:
        """The first entry group `group` must hold while the next token computed is at
        `first_pos` (0 but for sliding-window groups, hybrid_kv.py)."""
        return 0

    def tier_blocks(self, first: int, last: int) -> list[tuple[int, int]]:
        """(group, block index) of every block a prefix hit of `last` blocks needs at
        indices >= `first`: what a tier load must supply beyond `first` pool blocks."""
        out = []
        for j in range(len(self.group_windows)):
            keep = self.first_kept_block(j, last * self.block_size)
            out.extend((j, i) for i in range(max(first, keep), last))
        return out

    def tier_hit(self, request: Request, num_cached: int) -> int:
        """Tokens computed once `request`'s prefix from the KV tiers (`Request.tier_prefix`:
        engine/kv_tiering.py) joins the `num_cached` of the pool: more only where the
        tiers hold every block needed from there on, one token always left to compute."""
        staged = request.tier_prefix
        if staged is None:
            return num_cached
        first, last = num_cached // self.block_size, staged.num_blocks
        if first < staged.first_block or last <= first or last * self.block_size >= request.num_tokens \
                or any(b not in staged.data for b in self.tier_blocks(first, last)):
            return num_cached
        return last * self.block_size

    def tier_loads(self, request: Request, num_cached: int, loaded: int) -> list[tuple[int, object]]:
        """(block id, bytes) to write into the blocks the first allocation set aside for
        tokens [num_cached, loaded) (tier_hit's); the staged prefix is consumed."""
        staged, request.tier_prefix = request.tier_prefix, None
        if loaded <= num_cached:
            return []
        tables, bs = self.tables(request), self.block_size
        return [(tables[j][i], staged.data[(j, i)])
                for j, i in self.tier_blocks(num_cached // bs, loaded // bs)]

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def tables(self, request: Request) -> list[list[int]]:
        """The request's block tables, one per KV group (here: one)."""
        return [request.block_ids]

    def held_blocks(self) -> dict[str, int]:
        """Blocks referenced by live requests, by attention type."""
        return {"full": self.block_pool.num_used_blocks}

    def max_tokens_for_one(self, max_chunk_tokens: int) -> int:
        """The longest context one request can hold in the whole pool."""
        return self.block_pool.num_usable_blocks * self.block_size

    def handover_block_ids(self, tables: list[list[int]], num_cached: int,
                           num_prompt: int) -> list[int]:
        """The blocks of `tables` a peer lacks: prompt positions [num_cached, num_prompt)."""
        return tables[0][num_cached // self.block_size:cdiv(num_prompt, self.block_size)]

    def handover_group_sizes(self, num_cached: int, num_prompt: int) -> list[int]:
        """Per KV group, how many of handover_block_ids' blocks are its (in that order)."""
        return [max(0, cdiv(num_prompt, self.block_size) - num_cached // self.block_size)]

    def trim(self, request: Request, first_pos: int) -> None:
        """Release blocks no token from `first_pos` on reads (none here)."""

    def get_block_ids(self, request_id: str) -> list[int]:
        request = self._requests.get(request_id)
        return list(request.block_ids) if request is not None else []

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest cached prefix of the request, in full blocks: (block ids, num tokens).

        Never covers the whole sequence: at least one token is left to compute so the
        step has logits to sample from.
        """
        if not self.block_pool.enable_prefix_caching:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._update_block_hashes(request, max_hit_blocks)
        blocks: list[int] = []
        for block_hash in hashes[:max_hit_blocks]:
            block_id = self.block_pool.get_cached_block(block_hash)
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks, len(blocks) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[int] | None = None,
        first_pos: int | None = None,
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones.

        `new_computed_blocks` (prefix hits from get_computed_blocks, first allocation
        only) are shared, not copied. Returns the newly allocated block ids, or None
        when there is not enough free space (nothing changes then). `first_pos` (the
        next position computed) matters to sliding-window groups only (hybrid_kv.py).
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        computed = list(new_computed_blocks or [])
        if computed and request.block_ids:
            raise ValueError(
                f"request {request.request_id}: prefix hits only at the first allocation"
            )
        num_tokens = request.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        num_required = cdiv(num_tokens, self.block_size)
        num_new_blocks = max(0, num_required - len(request.block_ids) - len(computed))
        # Hit blocks with ref 0 sit in the free queue: reviving them uses free space.
        num_revived = sum(1 for b in computed if self.block_pool.ref_count(b) == 0)
        if num_new_blocks + num_revived > self.block_pool.num_free_blocks:
            return None
        pool = self.block_pool
        first = request.request_id not in self._requests
        pool.touch(computed)
        new_blocks = pool.get_new_blocks(num_new_blocks)
        request.block_ids.extend(computed)
        request.block_ids.extend(new_blocks)
        if first:
            self._requests[request.request_id] = request
            self._num_cached_blocks[request.request_id] = len(computed)
            if pool.enable_prefix_caching:
                pool.record_prefix_lookup(request.num_tokens, len(computed) * self.block_size)
        return new_blocks

    def cache_full_blocks(self, request: Request) -> None:
        """Hash and register the request's blocks that are full of computed KV."""
        if not self.block_pool.enable_prefix_caching:
            return
        rid = request.request_id
        if rid not in self._requests:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_ids))
        start = self._num_cached_blocks[rid]
        if num_full <= start:
            return
        hashes = self._update_block_hashes(request, num_full)
        for i in range(start, num_full):
            block_id = request.block_ids[i]
            if self.block_pool.cache_block(block_id, hashes[i]) and self._offloads is not None:
                self._log_offload(block_id, 0, hashes[i])
        self._num_cached_blocks[rid] = num_full

    def truncate(self, request: Request, num_blocks: int) -> None:
        """Release the request's blocks from index `num_blocks` on (rejected guesses of a
        speculative step: engine/spec_decode/); never one hashed into the prefix cache."""
        if num_blocks < self._num_cached_blocks.get(request.request_id, 0):
            raise ValueError(f"request {request.request_id}: cannot drop cached blocks")
        tail = request.block_ids[num_blocks:]
        if tail:
            del request.block_ids[num_blocks:]
            self.block_pool.free_blocks(tail, reuse_first=True)  # (never cached)

    def free(self, request: Request) -> None:
        """Release the request's blocks (tail first, so its prefix is evicted last)."""
        self._requests.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        if request.block_ids:
            self.block_pool.free_blocks(reversed(request.block_ids))
            request.block_ids.clear()

    def _update_block_hashes(self, request: Request, num_blocks: int) -> list[int]:
        """Extend the request's hash chain to cover its first `num_blocks` full blocks."""
        hashes = request.block_hashes
        bs = self.block_size
        num_blocks = min(num_blocks, request.num_tokens // bs)
        tokens = request.all_token_ids
        for i in range(len(hashes), num_blocks):
            parent = hashes[i - 1] if i > 0 else None
            hashes.append(hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs]))
        return hashes
