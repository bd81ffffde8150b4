"""KVCacheStorage, group_contiguous, the TP/DP mapping and the metrics text."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from xllm_py.kv_transfer.base import group_contiguous, runs_to_ids
from xllm_py.kv_transfer.kv_storage import KV_LAYOUT, KVCacheStorage, huge_page_allocator
from xllm_py.kv_transfer.metrics import KVTransferMetrics


def make_storage(num_blocks: int = 16, dtype: str = "float32") -> KVCacheStorage:
    return KVCacheStorage(num_layers=3, num_blocks=num_blocks, block_size=4, num_kv_heads=2, head_dim=8, dtype=dtype)


def test_storage_shape_views_and_meta() -> None:
    s = make_storage()
    assert s.kv.shape == (2, 3, 16, 4, 2, 8) and torch.count_nonzero(s.kv) == 0
    caches = s.layer_caches()
    assert len(caches) == 3
    caches[1][1][5, 2, 1, 7] = 3.5  # the model writes through the view
    assert s.kv[1, 1, 5, 2, 1, 7] == 3.5
    assert s.block_bytes == 2 * 3 * 4 * 2 * 8 * 4
    assert s.meta.layout == KV_LAYOUT == "kv,layer,block,slot,head,dim"
    assert s.meta.dtype == "float32" and s.meta.num_blocks == 16
    assert make_storage(dtype="bfloat16").meta.dtype == "bfloat16"


def test_read_write_round_trip_every_byte() -> None:
    a, b = make_storage(), make_storage()
    a.kv.copy_(torch.randn_like(a.kv))
    src, dst = [7, 2, 3, 15], [0, 9, 4, 1]
    buf = a.read_blocks(src)
    assert buf.shape == (2, 3, 4, 4, 2, 8) and buf.is_contiguous()
    b.write_blocks(dst, buf)
    for s_id, d_id in zip(src, dst):
        assert torch.equal(b.kv[:, :, d_id], a.kv[:, :, s_id])
    untouched = sorted(set(range(16)) - set(dst))
    assert torch.count_nonzero(b.kv[:, :, untouched]) == 0


def test_bfloat16_round_trip() -> None:
    a, b = make_storage(dtype="bfloat16"), make_storage(dtype="bfloat16")
    a.kv.copy_(torch.randn(a.kv.shape))
    b.write_blocks([1, 2], a.read_blocks([3, 4]))
    assert torch.equal(b.kv[:, :, 1:3].view(torch.int16), a.kv[:, :, 3:5].view(torch.int16))


@pytest.mark.parametrize("ids", [[16], [-1], [0, 99]])
def test_out_of_range_ids_refused(ids: list[int]) -> None:
    s = make_storage()
    with pytest.raises(ValueError, match="out of range"):
        s.check_block_ids(ids)
    with pytest.raises(ValueError, match="out of range"):
        s.read_blocks(ids)
    with pytest.raises(ValueError, match="out of range"):
        s.write_blocks(ids, torch.zeros(2, 3, len(ids), 4, 2, 8))


def test_write_checks_buffer_and_duplicates() -> None:
    s = make_storage()
    with pytest.raises(ValueError, match="duplicate"):
        s.write_blocks([1, 1], torch.zeros(2, 3, 2, 4, 2, 8))
    with pytest.raises(ValueError, match="elements"):
        s.write_blocks([1], torch.zeros(10))
    with pytest.raises(ValueError, match="dtype"):
        s.write_blocks([1], torch.zeros(2, 3, 1, 4, 2, 8, dtype=torch.float64))


def test_bad_construction() -> None:
    with pytest.raises(ValueError):
        KVCacheStorage(0, 4, 4, 1, 1)
    with pytest.raises(ValueError, match="dtype"):
        KVCacheStorage(1, 4, 4, 1, 1, dtype="int3")


def test_allocator_pools_are_used_as_given() -> None:
    nbytes = 2 * 3 * 16 * 4 * 2 * 8 * 4
    s = KVCacheStorage(3, 16, 4, 2, 8, allocator=huge_page_allocator)
    assert s.kv.data_ptr() % (2 << 20) == 0 and s.nbytes == nbytes
    assert int(torch.count_nonzero(s.kv)) == 0
    blocks = torch.randn(s.blocks_shape(3))
    s.write_blocks([2, 9, 15], blocks)
    assert torch.equal(s.read_blocks([2, 9, 15]), blocks)
    with pytest.raises(ValueError, match="allocator must return"):  # wrong size
        KVCacheStorage(3, 16, 4, 2, 8, allocator=lambda n: torch.zeros(n - 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="allocator must return"):  # not bytes
        KVCacheStorage(3, 16, 4, 2, 8, allocator=lambda n: torch.zeros(n // 4))


@pytest.mark.parametrize("src,dst,expected", [
    ([], [], []),
    ([5], [9], [(5, 9, 1)]),
    ([0, 1, 2, 10, 11, 20], [5, 6, 7, 15, 16, 25], [(0, 5, 3), (10, 15, 2), (20, 25, 1)]),
    ([0, 1, 2, 3], [4, 5, 9, 10], [(0, 4, 2), (2, 9, 2)]),        # dst breaks
    ([3, 2, 1], [0, 1, 2], [(3, 0, 1), (2, 1, 1), (1, 2, 1)]),     # descending src
    ([1, 2, 2, 3], [1, 2, 3, 4], [(1, 1, 2), (2, 3, 2)]),          # repeated src
])
def test_group_contiguous_hand_cases(src, dst, expected) -> None:
    assert group_contiguous(src, dst) == expected
    s, d = runs_to_ids(expected)
    assert s.tolist() == list(src) and d.tolist() == list(dst)


def test_group_contiguous_length_mismatch() -> None:
    with pytest.raises(ValueError, match="differ"):
        group_contiguous([1, 2], [1])


@pytest.mark.parametrize("seed", range(20))
def test_group_contiguous_random_reassembles(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 200))
    src = rng.permutation(300)[:n] if seed % 2 else np.sort(rng.permutation(300)[:n])
    dst = np.arange(n) + int(rng.integers(0, 50)) if seed % 3 else rng.permutation(400)[:n]
    runs = group_contiguous(src, dst)
    s, d = runs_to_ids(runs)
    assert s.tolist() == src.tolist() and d.tolist() == dst.tolist()
    # maximal: consecutive runs could not have been merged
    for a, b in zip(runs, runs[1:]):
        assert not (b[0] == a[0] + a[2] and b[1] == a[1] + a[2])


def test_metrics_render() -> None:
    m = KVTransferMetrics()
    m.observe_success("pull", 1000, 2, 0.003)
    m.observe_success("pull", 500, 1, 20.0)
    m.observe_failure("push", "timeout")
    text = m.render()
    assert 'xllm_kv_transfer_bytes_total{op="pull",rank="0"} 1500.0' in text
    assert 'xllm_kv_transfer_blocks_total{op="pull",rank="0"} 3.0' in text
    assert 'xllm_kv_transfer_failures_total{op="push",rank="0",reason="timeout"} 1.0' in text
    assert 'xllm_kv_transfer_seconds_bucket{le="0.0025",op="pull",rank="0"} 0.0' in text
    assert 'xllm_kv_transfer_seconds_bucket{le="0.005",op="pull",rank="0"} 1.0' in text
    assert 'xllm_kv_transfer_seconds_bucket{le="+Inf",op="pull",rank="0"} 2.0' in text
    assert 'xllm_kv_transfer_seconds_count{op="pull",rank="0"} 2.0' in text
    assert "# TYPE xllm_kv_transfer_seconds histogram" in text


def test_read_blocks_into_pooled_buffer_and_raw_bytes_write() -> None:
    from xllm_py.kv_transfer.kv_storage import StagingPool

    a, b = make_storage(), make_storage()
    a.kv.copy_(torch.randn_like(a.kv))
    pool = StagingPool()
    buf = pool.acquire(3 * a.block_bytes)
    out = a.read_blocks([9, 1, 4], out=buf)
    assert out.shape == (2, 3, 3, 4, 2, 8) and out.data_ptr() == buf.data_ptr()
    b.write_blocks([0, 2, 15], buf)  # raw bytes
    assert torch.equal(b.kv[:, :, [0, 2, 15]], a.kv[:, :, [9, 1, 4]])
    pool.release(buf)
    again = pool.acquire(2 * a.block_bytes)  # reuses the pooled buffer
    assert again.data_ptr() == buf.data_ptr() and again.numel() == 2 * a.block_bytes
    with pytest.raises(ValueError, match="contiguous"):
        a.read_blocks([1], out=torch.empty(7, dtype=torch.uint8))


@pytest.mark.parametrize("n", [3, 64, 65, 300])  # Python-int path up to 64 ids, numpy above
def test_check_block_ids_same_verdict_for_short_and_long_lists(n: int) -> None:
    s = KVCacheStorage(1, 400, 4, 2, 8)
    ids = np.arange(n)[::-1].copy()
    assert s.check_block_ids(ids, unique=True).tolist() == ids.tolist()
    dup = ids.copy()
    dup[-1] = dup[0]
    assert s.check_block_ids(dup).tolist() == dup.tolist()
    with pytest.raises(ValueError, match="duplicate"):
        s.check_block_ids(dup, unique=True)
    for bad in (-1, 400):
        out = ids.copy()
        out[n // 2] = bad
        with pytest.raises(ValueError, match=rf"out of range \[0, 400\): \[{bad}\]"):
            s.check_block_ids(out)
