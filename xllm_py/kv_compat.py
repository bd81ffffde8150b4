"""Which instance properties must agree for two KV pools to exchange blocks, and the
lenient rule for comparing them (one place: the PD link check and the worker's
LinkCluster both use it). Pure Python."""
from __future__ import annotations

from typing import Any

KV_COMPAT_FIELDS = ("model", "block_size", "kv_dtype", "kv_layout", "num_layers",
                    "num_kv_heads", "head_dim")


def kv_compat_differences(ours: Any, theirs: Any) -> list[tuple[str, Any, Any]]:
    """(field, ours, theirs) for each KV field that differs. A field left unset (0 / "")
    on either side is not compared: its writer did not know it."""
    out = []
    for field in KV_COMPAT_FIELDS:
        a, b = getattr(ours, field), getattr(theirs, field)
        if a in (0, "") or b in (0, ""):
            continue
        if a != b:
            out.append((field, a, b))
    return out
