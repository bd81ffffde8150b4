"""KV tiers below an engine's pool: host memory, a local disk and a shared Mooncake Store.

`keys.py` names a block (its chain hash plus everything that makes KV incompatible),
`host.py` / `disk.py` / `store.py` are the tiers, `stack.py` puts them in order with a
background writer and the lookups a prompt's prefix needs. Bytes in, bytes out: no torch
here (the engine's `engine/kv_tiering.py` gathers and scatters blocks of its pool).
"""
