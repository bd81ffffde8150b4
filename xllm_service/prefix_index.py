"""PrefixIndex: which prefix-cache blocks each engine holds, from its heartbeats'
`cache_event` (block hashes stored / removed since the previous heartbeat).

The hashes are the engines' own chain (`block_pool.hash_block_tokens`: a block's hash
covers every token before it), so the service finds how many leading blocks of a prompt
an instance has cached by hashing the prompt's full blocks and walking them in order.
Engines send a full snapshot (`full`) to a new master, after a failed heartbeat and every
30 s, so events lost with a heartbeat, or held by a previous master, skew it only until
then; it is a routing hint either way, never a reason a request fails.
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


class PrefixIndex:
    def __init__(self) -> None:
        self._blocks: dict[str, set[int]] = collections.defaultdict(set)

    def update(self, name: str, stored: Sequence[bytes], removed: Sequence[bytes],
               full: bool = False) -> None:
        """Registry.on_cache_event callback."""
        if full:
            self._blocks[name] = {hash_from_bytes(b) for b in stored}
            return
        blocks = self._blocks[name]
        blocks.difference_update(hash_from_bytes(b) for b in removed)
        blocks.update(hash_from_bytes(b) for b in stored)

    def forget(self, name: str) -> None:
        self._blocks.pop(name, None)

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
