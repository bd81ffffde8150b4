"""AttentionMetadata.build and paged attention against a dense per-sequence reference."""

from __future__ import annotations

import pytest
import torch

from xllm_py.model import attention, cpu_kernels
from xllm_py.model.attention import (
    AttentionMetadata,
    allocate_kv_caches,
    build_positions,
    paged_attention,
    plan_attention,
)

H, KVH, HD, BS, NB = 4, 2, 8, 4, 32


def test_build_exact_tensors():
    md = AttentionMetadata.build([(0, 3, [5]), (6, 1, [2, 7]), (3, 4, [1, 9])], block_size=4)
    # seq0 pos 0..2 in block 5; seq1 pos 6 -> block 7 offset 2; seq1 pos 3..6 -> 1:3, 9:0..2
    assert md.slot_mapping.tolist() == [20, 21, 22, 30, 7, 36, 37, 38]
    assert md.query_start_loc.tolist() == [0, 3, 4, 8]
    assert md.seq_lens.tolist() == [3, 7, 7]
    assert md.context_lens.tolist() == [0, 6, 3]
    assert md.block_tables.tolist() == [[5, 0], [2, 7], [1, 9]]
    assert (md.max_query_len, md.max_seq_len) == (4, 7)
    assert build_positions([(0, 3, [5]), (6, 1, [2, 7])]).tolist() == [0, 1, 2, 6]


def test_build_rejects_short_block_table():
    with pytest.raises(ValueError, match="block table of 1 blocks holds 4 tokens, needs 5"):
        AttentionMetadata.build([(0, 5, [3])], block_size=4)
    with pytest.raises(ValueError, match="num_new_tokens > 0"):
        AttentionMetadata.build([(2, 0, [3])], block_size=4)


def _reference(q_all, k_all, v_all, start, n):
    """Dense causal attention of positions start..start+n-1 over 0..start+n-1."""
    q = q_all[start:start + n].transpose(0, 1)  # [H, n, HD]
    k = k_all[: start + n].repeat_interleave(H // KVH, dim=1).transpose(0, 1)
    v = v_all[: start + n].repeat_interleave(H // KVH, dim=1).transpose(0, 1)
    scores = q @ k.transpose(-1, -2) / HD ** 0.5
    mask = torch.arange(start + n)[None, :] <= torch.arange(start, start + n)[:, None]
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)  # [n, H, HD]


@pytest.mark.parametrize("steps", [
    # each step: list of (seq, num_new_tokens); mixed prefill chunks, prefix hits and decodes
    [[(0, 9), (1, 3), (2, 1)], [(0, 1), (1, 6), (2, 1)], [(0, 1), (1, 1), (2, 5)]],
    [[(0, 1), (1, 1), (2, 1)], [(0, 1), (1, 1), (2, 1)]],  # all-decode fast path
    [[(0, 13)], [(0, 7)]],  # prefill only, chunked
])
@pytest.mark.parametrize("dense", [False, True], ids=["paged", "dense-chunks"])
def test_paged_attention_matches_dense(steps, dense, monkeypatch):
    if dense:  # chunks of >= 5 tokens and 40 pairs take the dense (SDPA) path on CPU
        monkeypatch.setattr(attention, "DENSE_PREFILL_MIN_TOKENS", 5)
        monkeypatch.setattr(attention, "DENSE_PREFILL_MIN_PAIRS", 40)
    g = torch.Generator().manual_seed(0)
    total = 40
    qs = torch.randn(3, total, H, HD, generator=g)
    ks = torch.randn(3, total, KVH, HD, generator=g)
    vs = torch.randn(3, total, KVH, HD, generator=g)
    k_cache, v_cache = allocate_kv_caches(1, NB, BS, KVH, HD)[0]
    tables = {0: [3, 17, 8, 1, 30, 12, 22, 9, 4, 11], 1: [2, 5, 29, 14, 6, 19, 23, 10, 25, 13],
              2: [7, 16, 27, 20, 18, 21, 15, 24, 26, 28]}
    done = {0: 0, 1: 0, 2: 0}
    for step in steps:
        seqs = [(done[s], n, tables[s]) for s, n in step]
        md = AttentionMetadata.build(seqs, BS)
        plan = plan_attention(md, BS)
        dense_lens = sorted(c.rows.stop - c.rows.start for c in plan.prefill.dense) \
            if plan.prefill is not None else []
        assert dense_lens == sorted(n for s, n in step if dense and n >= 5 and
                                    n * (done[s] + n) >= 40)
        q = torch.cat([qs[s, done[s]:done[s] + n] for s, n in step])
        k = torch.cat([ks[s, done[s]:done[s] + n] for s, n in step])
        v = torch.cat([vs[s, done[s]:done[s] + n] for s, n in step])
        out = paged_attention(q, k, v, k_cache, v_cache, plan)
        ref = torch.cat([_reference(qs[s], ks[s], vs[s], done[s], n) for s, n in step])
        assert out.shape == (len(q), H, HD)
        assert (out - ref).abs().max().item() < 1e-5
        for s, n in step:
            done[s] += n


@pytest.mark.parametrize("prefix,n,dense", [
    (128, 16, True),    # a chunk after a cached prefix: the dense path from 16 tokens
    (128, 15, False),
    (127, 16, False),   # a shorter prefix: the whole-prompt thresholds (64 tokens, 64k pairs)
    (0, 48, False),
    (200, 40, True),
])
def test_a_chunk_after_a_cached_prefix_takes_the_dense_path(prefix, n, dense):
    """Beside a decode sequence (a mixed step, as on a decode instance that prefills), the
    chunk's rows come out equal to the reference either way."""
    total = prefix + n
    nblk = -(-total // BS)
    g = torch.Generator().manual_seed(1)
    q_all = torch.randn(total, H, HD, generator=g)
    k_all = torch.randn(total, KVH, HD, generator=g)
    v_all = torch.randn(total, KVH, HD, generator=g)
    k_cache, v_cache = allocate_kv_caches(1, nblk + 4, BS, KVH, HD)[0]
    table = list(range(2, nblk + 2))
    if prefix:  # the cached prefix
        md = AttentionMetadata.build([(0, prefix, table)], BS)
        paged_attention(q_all[:prefix], k_all[:prefix], v_all[:prefix], k_cache, v_cache,
                        plan_attention(md, BS))
    md = AttentionMetadata.build([(prefix, n, table), (0, 1, [1])], BS)
    plan = plan_attention(md, BS)
    assert attention.takes_dense_path(n, prefix) is dense
    assert [c.rows.stop - c.rows.start for c in plan.prefill.dense] == ([n] if dense else [])
    q = torch.cat([q_all[prefix:], torch.randn(1, H, HD, generator=g)])
    k = torch.cat([k_all[prefix:], torch.randn(1, KVH, HD, generator=g)])
    v = torch.cat([v_all[prefix:], torch.randn(1, KVH, HD, generator=g)])
    out = paged_attention(q, k, v, k_cache, v_cache, plan)
    ref = _reference(q_all, k_all, v_all, prefix, n)
    assert (out[:n] - ref).abs().max().item() < 1e-5


def test_decode_only_plan_uses_fast_path():
    md = AttentionMetadata.build([(5, 1, [1, 2]), (2, 1, [3])], BS)
    plan = plan_attention(md, BS)
    assert plan.prefill is None and plan.decode is not None and plan.decode.token_idx is None
    assert plan.decode.key_mask.shape == (2, 1, 1, 8)
    assert plan.decode.key_mask[:, 0, 0].sum(-1).tolist() == [6, 3]


@pytest.mark.parametrize("window", [0, 6])
@pytest.mark.parametrize("dense", [False, True], ids=["paged", "dense-chunks"])
def test_retable_equals_a_plan_of_the_other_groups_tables(window, dense, monkeypatch):
    """A hybrid model's other KV groups (model/kv_groups.py) re-use one plan per window
    over their own tables and slots: the same outputs as a plan made for them."""
    from xllm_py.model.attention import retable

    if dense:
        monkeypatch.setattr(attention, "DENSE_PREFILL_MIN_TOKENS", 5)
        monkeypatch.setattr(attention, "DENSE_PREFILL_MIN_PAIRS", 40)
    g = torch.Generator().manual_seed(2)
    # a decode at 9, a chunk of 7 after 4 cached, a whole prompt of 11
    steps = [(9, 1), (4, 7), (0, 11)]
    group1 = [[3, 17, 8], [2, 5, 29], [7, 16, 27]]
    group2 = [[12, 22, 9], [25, 13, 6], [19, 23, 10]]
    k_cache, v_cache = allocate_kv_caches(1, NB, BS, KVH, HD)[0]
    k_cache.normal_(generator=g)
    v_cache.normal_(generator=g)
    md = AttentionMetadata.build([(s, n, t) for (s, n), t in zip(steps, group1)], BS,
                                 group_tables=[[t] for t in group2])
    q = torch.randn(19, H, HD, generator=g)
    k = torch.randn(19, KVH, HD, generator=g)
    v = torch.randn(19, KVH, HD, generator=g)
    other = md.for_group(1)
    direct = plan_attention(other, BS, window)
    moved = retable(plan_attention(md, BS, window), other, BS)
    assert torch.equal(moved.slot_mapping, direct.slot_mapping)
    outs = []
    for plan in (direct, moved):
        kc, vc = k_cache.clone(), v_cache.clone()
        outs.append(paged_attention(q, k, v, kc, vc, plan))
    assert torch.equal(outs[0], outs[1])
    if dense:
        assert moved.prefill.dense and all(
            torch.equal(a.key_slots, b.key_slots)
            for a, b in zip(moved.prefill.dense, direct.prefill.dense))


@pytest.mark.skipif(not cpu_kernels.available(), reason="the dense path is the kernels' (CPU)")
@pytest.mark.parametrize("prefix,n", [(0, 700), (40, 600), (300, 520)])
def test_a_long_chunk_in_a_window_is_attended_by_tiles(prefix, n, monkeypatch):
    """Past WINDOW_TILE + window keys a windowed dense chunk goes by tiles of query rows,
    each over the keys its window reaches: what one masked call over the whole chunk gives,
    to float32 rounding (another order of the same sums)."""
    window, bs = 100, 16
    monkeypatch.setattr(attention, "WINDOW_TILE", 128)
    torch.manual_seed(3)
    total = prefix + n
    nblk = (total + bs - 1) // bs
    k_cache, v_cache = allocate_kv_caches(1, nblk + 1, bs, KVH, HD)[0]
    slots = torch.arange(bs, (nblk + 1) * bs)[:total]
    k_cache.view(-1, KVH, HD)[slots] = torch.randn(total, KVH, HD)
    v_cache.view(-1, KVH, HD)[slots] = torch.randn(total, KVH, HD)
    md = AttentionMetadata.build([(prefix, n, list(range(1, nblk + 1)))], bs)
    g = plan_attention(md, bs, window).prefill
    assert len(g.dense) == 1
    c = g.dense[0]
    calls = []
    real = attention.dense_chunk_attention
    monkeypatch.setattr(attention, "dense_chunk_attention",
                        lambda *a: calls.append((a[0].shape[0], a[3].shape[0])) or real(*a))
    q = torch.randn(n, H, HD)
    tiled = attention._prefill_attention(q, k_cache, v_cache, g)
    whole = real(q, k_cache, v_cache, c.key_slots, c.mask)
    assert len(calls) == (n + 127) // 128
    assert all(keys <= 128 + window - 1 for _, keys in calls)
    assert torch.allclose(tiled, whole, atol=1e-5, rtol=1e-5)
