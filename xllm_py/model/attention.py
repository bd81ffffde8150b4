"""Paged attention over per-layer KV caches.

Cache layout (docs/DESIGN.md): per layer K and V, each
``[num_blocks, block_size, num_kv_heads, head_dim]``; a token's slot is
``block_id * block_size + offset``.

One step runs in three stages:
1. ``AttentionMetadata`` (attention_metadata.py) describes the ragged batch (built by
   the caller, e.g. with ``AttentionMetadata.build``).
2. ``plan_attention`` turns it into index/mask tensors once per step (shared by all layers).
3. Per layer, the new K/V go to ``slot_mapping`` (``write_kv``, or the model's fused
   q/k-norm + RoPE + store kernel), then ``attend``: decode sequences (one new token) and
   prefill chunks (several tokens, possibly after a cached prefix) take separate paths.
   On CPU float32 both go through the native paged kernel, which reads the blocks in
   place (a prefill token is a decode query over its causal prefix), except a long
   prefill chunk, or a chunk after a cached prefix (``takes_dense_path``): its context
   is gathered once and goes through ``scaled_dot_product_attention`` (causal), which
   tiles the queries and reads each key once per tile where the paged kernel reads the
   whole prefix once per query token; elsewhere each sequence's context is gathered by
   block table into a padded, masked ``scaled_dot_product_attention``.
   ``paged_attention`` is the two together.

Unused cache slots are read (and masked out); allocate caches with ``torch.zeros`` so they
never hold NaN/Inf, which a mask cannot cancel.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from xllm_py.model import cpu_kernels
from xllm_py.model.attention_metadata import AttentionMetadata, build_positions  # noqa: F401

logger = logging.getLogger(__name__)

# A prefill chunk takes the dense path on CPU (gather the context once, causal SDPA) from
# this many tokens and (query, key) pairs: below them the paged per-token kernel is as
# fast, above them the dense path wins as the pairs grow (benchmarks/bench_attention.py;
# figures in docs/benchmarks.md).
DENSE_PREFILL_MIN_TOKENS = 64
DENSE_PREFILL_MIN_PAIRS = 256 * 256
# A chunk after a cached prefix takes it from fewer tokens: the paged kernel reads the
# whole prefix once per query token, the dense path once per chunk. From 16 tokens after
# 128 cached the dense path is the faster; at 8 tokens the two are level, so short
# chunks stay paged.
DENSE_CHUNK_MIN_TOKENS = 16
DENSE_CHUNK_MIN_PREFIX = 128
# Query rows per SDPA call of a long dense chunk in a sliding window: a tile reads only the
# keys its rows' windows reach (at most WINDOW_TILE + window - 1), where the whole chunk in
# one masked call computes every (query, key) pair of it (no causal skipping with a mask):
# on a 2,048-token chunk in a 512-token window, ~2.7x fewer pairs.
WINDOW_TILE = 256


def takes_dense_path(num_tokens: int, prefix: int) -> bool:
    """Whether a prefill chunk of `num_tokens` after `prefix` cached tokens is attended on
    the dense path (CPU float32; elsewhere the paged kernel)."""
    if num_tokens >= DENSE_CHUNK_MIN_TOKENS and prefix >= DENSE_CHUNK_MIN_PREFIX:
        return True
    return (num_tokens >= DENSE_PREFILL_MIN_TOKENS
            and num_tokens * (prefix + num_tokens) >= DENSE_PREFILL_MIN_PAIRS)


@dataclass
class _DecodeGroup:
    token_idx: torch.Tensor | None  # [Bd] rows of q that belong here; None = all rows
    block_tables: torch.Tensor  # [Bd, nblk]
    seq_lens: torch.Tensor  # [Bd] int64
    block_size: int
    window: int = 0  # > 0: a query sees only its last `window` positions (sliding layers)
    seq_idx: torch.Tensor | None = None  # [Bd] its sequences in the batch; None = all

    @functools.cached_property
    def key_mask(self) -> torch.Tensor:
        """[Bd, 1, 1, nblk*bs] bool, True = attend (the torch path only: made on first use,
        the native kernels read seq_lens)."""
        key_pos = torch.arange(self.block_tables.shape[1] * self.block_size,
                               device=self.seq_lens.device)
        mask = key_pos[None, :] < self.seq_lens[:, None]
        if self.window:
            mask &= key_pos[None, :] >= self.seq_lens[:, None] - self.window
        return mask[:, None, None, :]


@dataclass
class _PrefillGroup:
    token_idx: torch.Tensor | None  # [Tp] rows of q that belong here; None = all rows
    dest: torch.Tensor  # [Tp] row in the padded [Bp * max_q] query layout
    num_seqs: int
    max_q: int
    block_tables: torch.Tensor  # [Bp, nblk]
    mask: torch.Tensor  # [Bp, 1, max_q, nblk*bs] bool, True = attend
    # per query token: its sequence's table [Tp, nblk] and its position + 1 [Tp] (the
    # native kernel takes each token as a decode query over its causal prefix)
    tok_tables: torch.Tensor
    tok_seq_lens: torch.Tensor
    # the long chunks (CPU dense path); the other rows of the group
    # (None = all of them) go to the native kernel
    dense: list["_DenseChunk"] = field(default_factory=list)
    paged_rows: torch.Tensor | None = None
    window: int = 0
    seq_idx: torch.Tensor | None = None  # [Bp] its sequences in the batch; None = all
    seq_of_tok: torch.Tensor | None = None  # [Tp] each query token's sequence in the group


@dataclass
class _DenseChunk:
    """One sequence's prefill chunk attended in one causal SDPA call."""

    rows: slice  # its query rows in the prefill group (contiguous)
    key_slots: torch.Tensor  # [len] cache slots of positions seq_len - len .. seq_len - 1
    mask: torch.Tensor | None  # [n, len] bool after a cached prefix or in a window; None = is_causal
    seq: int = 0  # its sequence in the prefill group
    key_pos: torch.Tensor | None = None  # [len] the positions of key_slots


@dataclass
class AttentionPlan:
    """Per-step tensors shared by every layer (built by ``plan_attention``)."""

    slot_mapping: torch.Tensor
    num_tokens: int
    decode: _DecodeGroup | None
    prefill: _PrefillGroup | None


def plan_attention(md: AttentionMetadata, block_size: int, window: int = 0) -> AttentionPlan:
    """Split the batch into its decode and prefill parts and build their masks; with
    ``window`` > 0 each query attends to its last ``window`` positions only (a
    sliding-window layer: keys at positions > query position - window)."""
    num_tokens = int(md.slot_mapping.shape[0])
    if md.max_query_len == 1:
        decode = _decode_group(None, md.block_tables, md.seq_lens, md.max_seq_len, block_size,
                               window)
        return AttentionPlan(md.slot_mapping, num_tokens, decode, None)
    q_lens = md.query_start_loc[1:] - md.query_start_loc[:-1]
    is_decode = (q_lens == 1).cpu()
    num_decode = int(is_decode.sum())
    if num_decode == 0:
        prefill = _prefill_group(None, md.query_start_loc, md.seq_lens, md.context_lens,
                                 md.block_tables, md.max_query_len, md.max_seq_len,
                                 block_size, num_tokens, window)
        return AttentionPlan(md.slot_mapping, num_tokens, None, prefill)
    # Mixed batch: one host sync per step (not per layer) to split the two groups.
    dev = md.seq_lens.device
    d_seq = torch.nonzero(is_decode).flatten().to(dev)
    p_seq = torch.nonzero(~is_decode).flatten().to(dev)
    seq_lens_host = md.seq_lens.cpu()
    d_tok = md.query_start_loc[d_seq]
    d_max = int(seq_lens_host[is_decode].max())
    decode = _decode_group(d_tok, md.block_tables[d_seq], md.seq_lens[d_seq], d_max, block_size,
                           window)
    decode.seq_idx = d_seq
    p_qsl_start = md.query_start_loc[p_seq]
    p_qlens = q_lens[p_seq]
    p_qsl = torch.zeros(p_seq.shape[0] + 1, dtype=torch.int64, device=dev)
    p_qsl[1:] = torch.cumsum(p_qlens, 0)
    num_p_tokens = num_tokens - num_decode
    seq_of_tok = torch.repeat_interleave(
        torch.arange(p_seq.shape[0], device=dev), p_qlens, output_size=num_p_tokens)
    offset_in_seq = torch.arange(num_p_tokens, device=dev) - p_qsl[:-1][seq_of_tok]
    p_tok = p_qsl_start[seq_of_tok] + offset_in_seq
    p_max_seq = int(seq_lens_host[~is_decode].max())
    prefill = _prefill_group(p_tok, p_qsl, md.seq_lens[p_seq], md.context_lens[p_seq],
                             md.block_tables[p_seq], md.max_query_len, p_max_seq,
                             block_size, num_p_tokens, window)
    prefill.seq_idx = p_seq
    return AttentionPlan(md.slot_mapping, num_tokens, decode, prefill)


def retable(plan: AttentionPlan, md: AttentionMetadata, block_size: int) -> AttentionPlan:
    """``plan`` (plan_attention of this step, any window) over the slots and block tables
    of ``md``: the same batch in another KV group's blocks (AttentionMetadata.for_group).
    The masks are shared; only what indexes the cache is made again."""
    d, p = plan.decode, plan.prefill
    if d is not None:
        tables = md.block_tables if d.seq_idx is None else md.block_tables[d.seq_idx]
        d = dataclasses.replace(d, block_tables=tables[:, :d.block_tables.shape[1]])
    if p is not None:
        tables = md.block_tables if p.seq_idx is None else md.block_tables[p.seq_idx]
        tables = tables[:, :p.block_tables.shape[1]]
        dense = [dataclasses.replace(c, key_slots=tables[c.seq, c.key_pos // block_size]
                                     * block_size + c.key_pos % block_size) for c in p.dense]
        p = dataclasses.replace(p, block_tables=tables, tok_tables=tables[p.seq_of_tok],
                                dense=dense)
    return AttentionPlan(md.slot_mapping, plan.num_tokens, d, p)


def plan_rows(md: AttentionMetadata, rows: torch.Tensor, positions: torch.Tensor,
              block_size: int, window: int = 0) -> AttentionPlan:
    """Attention for only the query tokens ``rows`` of the step (their K/V and every
    earlier token's already in the caches): each row attends to its sequence's context up
    to its own position, as a decode query. For a last layer whose other rows feed
    nothing (only sampled rows reach the logits)."""
    seq_of_row = torch.searchsorted(md.query_start_loc[1:], rows, right=True)
    seq_lens = positions[rows] + 1
    max_len = int(seq_lens.max()) if rows.numel() else 1
    decode = _decode_group(None, md.block_tables[seq_of_row], seq_lens, max_len, block_size,
                           window)
    return AttentionPlan(md.slot_mapping[rows], int(rows.shape[0]), decode, None)


def _num_blocks(max_seq_len: int, block_size: int) -> int:
    return (max_seq_len + block_size - 1) // block_size


def _decode_group(token_idx: torch.Tensor | None, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, max_seq_len: int, block_size: int,
                  window: int = 0) -> _DecodeGroup:
    nblk = _num_blocks(max_seq_len, block_size)
    return _DecodeGroup(token_idx, block_tables[:, :nblk], seq_lens, block_size, window)


def _prefill_group(token_idx: torch.Tensor | None, query_start_loc: torch.Tensor,
                   seq_lens: torch.Tensor, context_lens: torch.Tensor,
                   block_tables: torch.Tensor, max_q: int, max_seq_len: int,
                   block_size: int, num_tokens: int, window: int = 0) -> _PrefillGroup:
    dev = seq_lens.device
    num_seqs = int(seq_lens.shape[0])
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    seq_of_tok = torch.repeat_interleave(torch.arange(num_seqs, device=dev), q_lens,
                                         output_size=num_tokens)
    offset = torch.arange(num_tokens, device=dev) - query_start_loc[:-1][seq_of_tok]
    dest = seq_of_tok * max_q + offset
    nblk = _num_blocks(max_seq_len, block_size)
    key_pos = torch.arange(nblk * block_size, device=dev)
    q_pos = context_lens[:, None] + torch.arange(max_q, device=dev)[None, :]  # [B, max_q]
    # causal and within the sequence; padded query rows still see key 0 (no all -inf row)
    mask = (key_pos[None, None, :] <= q_pos[:, :, None]) & (
        key_pos[None, None, :] < seq_lens[:, None, None])
    if window:
        mask &= key_pos[None, None, :] > q_pos[:, :, None] - window
    tables = block_tables[:, :nblk]
    group = _PrefillGroup(token_idx, dest, num_seqs, max_q, tables, mask[:, None],
                          tables[seq_of_tok], context_lens[seq_of_tok] + offset + 1,
                          window=window, seq_of_tok=seq_of_tok)
    if max_q >= min(DENSE_PREFILL_MIN_TOKENS, DENSE_CHUNK_MIN_TOKENS):
        _plan_dense(group, query_start_loc, context_lens, block_size, num_tokens)
    return group


def _plan_dense(g: _PrefillGroup, query_start_loc: torch.Tensor, context_lens: torch.Tensor,
                block_size: int, num_tokens: int) -> None:
    """Picks the chunks long enough for the dense path (one host sync per step)."""
    dev = context_lens.device
    qsl = query_start_loc.tolist()
    ctx = context_lens.tolist()
    paged = torch.ones(num_tokens, dtype=torch.bool)
    for i in range(g.num_seqs):
        start, end = qsl[i], qsl[i + 1]
        n = end - start
        seq_len = ctx[i] + n
        # a window: the chunk's first query reads from position ctx - window + 1 on
        first = max(0, ctx[i] - g.window + 1) if g.window else 0
        if not takes_dense_path(n, ctx[i] - first):
            continue
        pos = torch.arange(first, seq_len, device=dev)
        slots = g.block_tables[i, pos // block_size] * block_size + pos % block_size
        mask = None
        if ctx[i] or (g.window and seq_len > g.window):
            q_pos = ctx[i] + torch.arange(n, device=dev)
            mask = pos[None, :] <= q_pos[:, None]
            if g.window:
                mask &= pos[None, :] > q_pos[:, None] - g.window
        g.dense.append(_DenseChunk(slice(start, end), slots, mask, i, pos))
        paged[start:end] = False
    if g.dense:
        g.paged_rows = torch.nonzero(paged).flatten().to(dev)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store new K/V rows ``[T, kvh, hd]`` at their slots."""
    kvh, hd = k_cache.shape[-2], k_cache.shape[-1]
    k_cache.view(-1, kvh, hd).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, kvh, hd).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _gather(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[num_blocks, bs, kvh, hd] by [B, nblk] -> [B, kvh, nblk*bs, hd]."""
    b, nblk = block_tables.shape
    bs, kvh, hd = cache.shape[1:]
    x = cache.index_select(0, block_tables.reshape(-1)).view(b, nblk * bs, kvh, hd)
    return x.transpose(1, 2)


def _attend_in_place(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     tables: torch.Tensor, seq_lens: torch.Tensor,
                     window: int = 0) -> torch.Tensor | None:
    """Row i of q attends to the first seq_lens[i] slots of table i (with ``window``: the
    last ``window`` of them), the blocks read in place by the native kernel (no gather, no
    mask); None when it does not apply."""
    if not cpu_kernels.decode_attention_supported(q, k_cache, v_cache):
        return None
    return cpu_kernels.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens,
                                              q.shape[-1] ** -0.5, window)


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      g: _DecodeGroup) -> torch.Tensor:
    out = _attend_in_place(q, k_cache, v_cache, g.block_tables, g.seq_lens, g.window)
    return out if out is not None else decode_attention_torch(q, k_cache, v_cache, g)


def decode_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           g: _DecodeGroup) -> torch.Tensor:
    """Gather + masked SDPA: the reference path (any device and dtype)."""
    # q [Bd, h, hd]; fold the GQA group into the query-length axis: [Bd, kvh, group, hd]
    bd, h, hd = q.shape
    kvh = k_cache.shape[2]
    qg = q.view(bd, kvh, h // kvh, hd)
    k = _gather(k_cache, g.block_tables)
    v = _gather(v_cache, g.block_tables)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=g.key_mask)
    return out.reshape(bd, h, hd)


def _prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       g: _PrefillGroup) -> torch.Tensor:
    if not cpu_kernels.decode_attention_supported(q, k_cache, v_cache):
        return prefill_attention_torch(q, k_cache, v_cache, g)
    if not g.dense:
        # each token a decode query over its causal prefix
        return _attend_in_place(q, k_cache, v_cache, g.tok_tables, g.tok_seq_lens, g.window)
    out = torch.empty_like(q)
    for c in g.dense:
        out[c.rows] = _dense_chunk(q[c.rows], k_cache, v_cache, c, g.window)
    rows = g.paged_rows
    if rows is not None and rows.numel():
        out.index_copy_(0, rows, _attend_in_place(q[rows], k_cache, v_cache,
                                                  g.tok_tables[rows], g.tok_seq_lens[rows],
                                                  g.window))
    return out


def _dense_chunk(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 c: _DenseChunk, window: int) -> torch.Tensor:
    """One dense chunk; in a window and longer than WINDOW_TILE past it, by tiles of query
    rows, each over the keys its window reaches (the same keys each query attends to)."""
    n, keys = q.shape[0], c.key_slots.shape[0]
    if not window or c.mask is None or keys <= window + WINDOW_TILE:
        return dense_chunk_attention(q, k_cache, v_cache, c.key_slots, c.mask)
    out = torch.empty_like(q)
    for a in range(0, n, WINDOW_TILE):  # the queries are the keys' last n positions
        b = min(n, a + WINDOW_TILE)
        lo, hi = max(0, keys - n + a - window + 1), keys - n + b
        out[a:b] = dense_chunk_attention(q[a:b], k_cache, v_cache, c.key_slots[lo:hi],
                                         c.mask[a:b, lo:hi])
    return out


def dense_chunk_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          key_slots: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """q [n, h, hd], the chunk's last n positions of the keys at ``key_slots`` ->
    [n, h, hd]; causal (``mask`` None: no cached prefix, no window) or by ``mask`` [n, len]."""
    kvh, hd = k_cache.shape[-2], k_cache.shape[-1]
    k = k_cache.view(-1, kvh, hd).index_select(0, key_slots).transpose(0, 1)
    v = v_cache.view(-1, kvh, hd).index_select(0, key_slots).transpose(0, 1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k[None], v[None], attn_mask=mask, is_causal=mask is None,
        enable_gqa=q.shape[1] != kvh)
    return out[0].transpose(0, 1)


def prefill_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            g: _PrefillGroup) -> torch.Tensor:
    """Gather + padded, masked SDPA: the reference path (any device and dtype)."""
    # q [Tp, h, hd] -> padded [Bp, h, max_q, hd]
    tp, h, hd = q.shape
    kvh = k_cache.shape[2]
    qp = q.new_zeros(g.num_seqs * g.max_q, h, hd).index_copy_(0, g.dest, q)
    qp = qp.view(g.num_seqs, g.max_q, h, hd).transpose(1, 2)
    k = _gather(k_cache, g.block_tables)
    v = _gather(v_cache, g.block_tables)
    out = F.scaled_dot_product_attention(qp, k, v, attn_mask=g.mask, enable_gqa=(h != kvh))
    out = out.transpose(1, 2).reshape(g.num_seqs * g.max_q, h, hd)
    return out.index_select(0, g.dest)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor,
                    plan: AttentionPlan) -> torch.Tensor:
    """q [T, h, hd], k/v [T, kvh, hd] (RoPE applied) -> [T, h, hd].

    Writes k/v into the caches first, then every query attends to its sequence's cached
    context up to and including its own position.
    """
    write_kv(k_cache, v_cache, k, v, plan.slot_mapping)
    return attend(q, k_cache, v_cache, plan)


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           plan: AttentionPlan) -> torch.Tensor:
    """q [T, h, hd] -> [T, h, hd], the step's K/V already in the caches."""
    if q.dtype != k_cache.dtype:
        q = q.to(k_cache.dtype)
    d, p = plan.decode, plan.prefill
    if p is None and d is not None and d.token_idx is None:
        return _decode_attention(q, k_cache, v_cache, d)
    if d is None and p is not None and p.token_idx is None:
        return _prefill_attention(q, k_cache, v_cache, p)
    out = torch.empty_like(q)
    if d is not None:
        out.index_copy_(0, d.token_idx, _decode_attention(q[d.token_idx], k_cache, v_cache, d))
    if p is not None:
        out.index_copy_(0, p.token_idx, _prefill_attention(q[p.token_idx], k_cache, v_cache, p))
    return out


def allocate_kv_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                       head_dim: int, dtype: torch.dtype = torch.float32,
                       device: torch.device | str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed caches as one ``[2, L, N, bs, kvh, hd]`` tensor, returned as per-layer views."""
    kv = torch.zeros(2, num_layers, num_blocks, block_size, num_kv_heads, head_dim,
                     dtype=dtype, device=device)
    return [(kv[0, i], kv[1, i]) for i in range(num_layers)]
