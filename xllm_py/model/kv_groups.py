"""KVGroups: how a model's layers share the paged KV pool by attention type (pure Python).

A model whose layers all attend to the whole context (Llama, Qwen) has one group: every
layer reads the request's one block table, the pool holds ``num_layers`` cache tensors.

A hybrid model (Gemma 3: sliding-window and full-attention layers) splits its layers into
groups of equal size ``g`` (as vLLM's hybrid KV cache manager does): one or more groups of
full-attention layers, then groups of sliding-window layers. The pool holds ``g`` cache
tensors ("slots"); layer ``i`` uses slot ``layer_slot[i]`` and the block table of its
group ``layer_group[i]``. One block id, taken by one group, is that group's ``g`` layers'
KV for ``block_size`` tokens, so every group draws from one pool of equal blocks: a
sliding group holds only the blocks of its window (the rest go back to the pool) and a
hand-over moves, per group, only the blocks it holds. Gemma 3 270M (3 full, 15 sliding
layers): g = 3, one full group and five sliding groups; a block is 3 layers' KV.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class KVGroups:
    num_slots: int  # cache tensors in the pool ("layers" of KVCacheStorage)
    group_windows: tuple[int, ...]  # per group: 0 = full attention, W = sliding window
    layer_group: tuple[int, ...]  # per model layer: its group (group 0: Request.block_ids)
    layer_slot: tuple[int, ...]  # per model layer: its cache tensor
    # per cache tensor, the model's slot it holds (a pipeline stage's pool: ``stage``);
    # () for the whole model's pool, where tensor s is slot s
    slots: tuple[int, ...] = ()

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def hybrid(self) -> bool:
        return len(self.group_windows) > 1

    def stage(self, start: int, end: int) -> "KVGroups":
        """The view of a pipeline stage holding model layers [start, end): the model's
        groups (the scheduler's block tables are the model's), ``layer_*`` per stage
        layer, a pool of only the slots those layers use (``slots``: which). A stage of
        sliding layers alone still reads its groups' tables; a block of a group none of
        the stage's layers belong to is simply not written there."""
        used = sorted({self.layer_slot[i] for i in range(start, end)})
        index = {s: k for k, s in enumerate(used)}
        return KVGroups(len(used), self.group_windows, self.layer_group[start:end],
                        tuple(index[self.layer_slot[i]] for i in range(start, end)),
                        tuple(used))

    def layer_caches(self, slot_caches: Sequence) -> list:
        """Per model layer, the (K, V) of its slot (``slot_caches``: one per slot)."""
        if len(slot_caches) != self.num_slots:
            raise ValueError(f"expected {self.num_slots} slot caches, got {len(slot_caches)}")
        return [slot_caches[s] for s in self.layer_slot]


def kv_groups(layer_windows: Sequence[int]) -> KVGroups:
    """The grouping for layers attending to ``layer_windows`` (0 = full context).

    Full-attention groups come first (group 0 is the request's main block table). Models
    with one attention type keep one group of every layer, the layout of before."""
    n = len(layer_windows)
    full = [i for i, w in enumerate(layer_windows) if not w]
    windows = sorted({w for w in layer_windows if w})
    if not full or not windows:
        return KVGroups(n, (0,), (0,) * n, tuple(range(n)))
    by_type = [full] + [[i for i, w in enumerate(layer_windows) if w == win] for win in windows]
    g = min(len(layers) for layers in by_type)
    group_windows: list[int] = []
    layer_group = [0] * n
    layer_slot = [0] * n
    for window, layers in zip([0] + windows, by_type):
        for start in range(0, len(layers), g):
            for slot, layer in enumerate(layers[start:start + g]):
                layer_group[layer] = len(group_windows)
                layer_slot[layer] = slot
            group_windows.append(window)
    return KVGroups(g, tuple(group_windows), tuple(layer_group), tuple(layer_slot))
