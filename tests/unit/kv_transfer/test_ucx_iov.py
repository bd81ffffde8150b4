"""UCX host data path: one iov tag message per pull (iov_protocol / iov_worker / ucp_ffi).

The conformance tests in test_transfer_backends.py cover pull/push/refusals/dead peers for
mode ``auto`` (= iov on host memory); these check the pieces and the fallbacks.
"""
from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import time

import numpy as np
import pytest
import torch

from tests.unit.ucx_utils import linked, storage
from tests.waiting import wait_until

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx not installed")


def test_request_roundtrip() -> None:
    from xllm_py.kv_transfer.ucx.iov_protocol import OP_PUSH, decode_request, encode_request

    op, req, tok, timeout, runs, heads = decode_request(encode_request(OP_PUSH, 7, 1 << 59, 2.5, [(1, 2, 3), (9, 8, 1)]))
    assert (op, req, tok, timeout, heads) == (OP_PUSH, 7, 1 << 59, 2.5, None)
    assert runs.tolist() == [[1, 2, 3], [9, 8, 1]]


async def _pull_every_byte(ba, a, bb, b, n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    src = rng.permutation(a.num_blocks)[:n]
    dst = rng.permutation(b.num_blocks)[:n]
    before = b.kv.clone()
    r = await bb.pull(ba.address, src, dst, timeout=10)
    assert r.num_bytes == n * b.block_bytes
    assert torch.equal(b.kv[:, :, dst], a.kv[:, :, src])
    rest = np.setdiff1d(np.arange(b.num_blocks), dst)
    assert torch.equal(b.kv[:, :, rest], before[:, :, rest])


@pytest.mark.integration
async def test_iov_path_is_used_and_moves_every_byte() -> None:
    a, b = storage(256, seed=1), storage(200)
    async with linked(a, b) as (ba, bb):
        assert bb._peers[ba.address].iov_key is not None
        served0 = ba.stats()["served"]  # the link's warm-up pulls count as served
        for n, seed in ((1, 0), (150, 1), (200, 2)):
            await _pull_every_byte(ba, a, bb, b, n, seed)
        # submit_pull from a plain thread takes the same fast path
        fut = bb.submit_pull(ba.address, [3, 2, 1], [0, 1, 2], timeout=10)
        assert fut.result(15).num_blocks == 3
        assert torch.equal(b.kv[:, :, [0, 1, 2]], a.kv[:, :, [3, 2, 1]])
        # the owner counts a request once its own sends completed, which may be just
        # after the puller has the bytes
        await wait_until(lambda: ba.stats()["served"] >= served0 + 4, 5, 0.01)
        assert ba.stats()["served"] == served0 + 4


@pytest.mark.integration
async def test_unreachable_iov_worker_falls_back_to_the_tag_path(monkeypatch) -> None:
    monkeypatch.setenv("XLLM_UCX_IOV_TLS", "self")  # reaches no other worker
    a, b = storage(seed=3), storage()
    async with linked(a, b) as (ba, bb):
        assert bb._peers[ba.address].iov_key is None
        await _pull_every_byte(ba, a, bb, b, 20, 4)
        assert (await bb.pull(ba.address, [3], [3], timeout=10)).path == "tag"
        await bb.push(ba.address, [1, 2], [60, 61], timeout=10)
        assert torch.equal(a.kv[:, :, [60, 61]], b.kv[:, :, [1, 2]])


@pytest.mark.integration
async def test_pull_timeout_fails_and_relinks() -> None:
    a, b = storage(seed=5), storage()
    async with linked(a, b) as (ba, bb):
        ba._iov.close()  # the owner's data worker stops answering; its control link stays up
        try:
            from xllm_py.kv_transfer import TransferError
            with pytest.raises(TransferError, match="timed out"):
                await bb.pull(ba.address, [1], [1], timeout=0.5)
            assert torch.count_nonzero(b.kv[:, :, 1]) == 0
            assert ba.address not in bb._peers  # dropped after the failure
        finally:
            ba._iov = None  # already closed


def test_iov_layout_matches_the_slices_for_fragmented_runs() -> None:
    from xllm_py.kv_transfer.ucx.iov_protocol import IovLayout, IovRequest, OP_PULL, OP_PUSH, decode_request

    s = storage(num_blocks=32)
    runs = np.array([[30, 0, 2], [3, 7, 1], [0, 31, 1]], dtype=np.int64)
    layout = IovLayout(s)
    for side in (0, 1):
        got = [tuple(map(int, c)) for c in layout.chunks(runs, side)]
        assert got == [(s.kv[k, layer, r[side]].data_ptr(), r[2] * s.slice_bytes)
                       for r in runs for k in range(2) for layer in range(3)]
    # a request names our side of each run: the destination of a pull, the source of a push
    pull, push = IovRequest(layout, OP_PULL, 5, 9, 1.0, runs), IovRequest(layout, OP_PUSH, 5, 9, 1.0, runs)
    assert np.array_equal(pull.chunks, layout.chunks(runs, 1))
    assert np.array_equal(push.chunks, layout.chunks(runs, 0))
    assert pull.nbytes == 4 * s.block_bytes == int(pull.chunks[:, 1].sum())
    assert decode_request(pull.msg)[4].tolist() == runs.tolist()


@contextlib.contextmanager
def _self_linked_worker():
    """An IovWorker with an endpoint to itself (key "self")."""
    from xllm_py.kv_transfer.ucx.env import import_ucxx
    from xllm_py.kv_transfer.ucx.iov_worker import IovWorker

    import_ucxx()
    w = IovWorker({"TLS": "sm,self"}, lambda *_: None, name="test-iov")
    try:
        w.connect("self", w.address).result(10)
        yield w
    finally:
        w.close()


def test_any_of_resumes_on_the_first_op_and_cancels_the_other() -> None:
    from xllm_py.kv_transfer.ucx import ucp_ffi as ffi
    from xllm_py.kv_transfer.ucx.iov_worker import KIND_DATA, KIND_STATUS, AnyOf, tag

    with _self_linked_worker() as w:
        left: list = []

        def make(track: list):
            a, _ = ffi.tag_recv_bytes(w.handle, 64, tag(KIND_DATA, 1))
            b, bbuf = ffi.tag_recv_bytes(w.handle, 64, tag(KIND_STATUS, 1))
            track += [a, b]
            left.append(a)
            track.append(ffi.tag_send_bytes(w.ep_handle("self"), b"status", tag(KIND_STATUS, 1)))
            yield AnyOf((a, b))
            return a.done, b.done, bbuf.raw[:b.info.length]

        assert w.start(make, timeout=10).result(10) == (False, True, b"status")
        # the receive nobody answered was cancelled when the task ended: no zombie left
        assert w.call(lambda: (left[0].poll(), left[0].status, len(w._zombies))).result(10) == \
            (True, ffi.UCS_ERR_CANCELED, 0)


def test_iov_receive_posted_after_the_data_arrived_gets_every_byte() -> None:
    """A pull sends its request before posting the DATA receive: an answer that is quicker
    still lands in place (UCX keeps it as an unexpected message until the receive is posted)."""
    from xllm_py.kv_transfer.ucx import ucp_ffi as ffi
    from xllm_py.kv_transfer.ucx.iov_protocol import IovLayout
    from xllm_py.kv_transfer.ucx.iov_worker import KIND_DATA, tag

    s = storage(num_blocks=16, seed=7)
    layout = IovLayout(s)
    src = np.array([[1, 9, 2], [6, 12, 1]], dtype=np.int64)  # blocks 1, 2, 6 -> 9, 10, 12
    with _self_linked_worker() as w:
        def make(track: list):
            sent = ffi.tag_send_iov(w.ep_handle("self"), layout.chunks(src, 0), tag(KIND_DATA, 3))
            track.append(sent)
            deadline = time.monotonic() + 5
            while not sent.poll() and time.monotonic() < deadline:  # delivered before the receive exists
                w._worker.progress_once()
            yield [sent]
            recv = ffi.tag_recv_iov(w.handle, layout.chunks(src, 1), tag(KIND_DATA, 3),
                                    expected=3 * layout.block_bytes)
            track.append(recv)
            yield [recv]

        w.start(make, timeout=10).result(10)
    assert torch.equal(s.kv[:, :, [9, 10, 12]], s.kv[:, :, [1, 2, 6]])


@pytest.mark.parametrize("pad", [0, 100])  # few runs (Python loop) and many (numpy)
def test_check_src_runs_refuses_anything_outside_the_pool(pad: int) -> None:
    from xllm_py.kv_transfer.ucx.iov_protocol import check_src_runs

    ok = [[0, 5, 1]] * pad

    def check(*rows: list[int]) -> str | None:
        return check_src_runs(np.array(ok + list(rows), dtype=np.int64).reshape(-1, 3), 64)

    assert check() is None
    assert check([0, 0, 64]) is None and check([63, 0, 1]) is None
    assert "positive" in check([3, 0, 0])
    assert "positive" in check([3, 0, -2])
    assert "[64]" in check([60, 0, 5])
    assert "[-1]" in check([-1, 0, 2])
    big = 2 ** 62
    assert str(big) in check([big, 0, big])  # no int64 overflow into a "valid" sum
    assert "out of range" in check([1, 0, 2 ** 63 - 1])


def test_scratch_pull_lands_in_the_scratch_buffer_in_the_cache_pieces() -> None:
    from xllm_py.kv_transfer.ucx.iov_protocol import IovLayout, IovRequest

    s = storage(num_blocks=16)
    layout = IovLayout(s)
    runs = np.array([[0, 0, 2], [5, 9, 1]], dtype=np.int64)
    scratch = np.zeros(3 * s.block_bytes, dtype=np.uint8)
    req = IovRequest.scratch_pull(layout, 1, 2, 1.0, runs, scratch)
    assert req.keep is scratch and req.nbytes == scratch.size
    assert req.chunks[:, 1].tolist() == layout.chunks(runs, 1)[:, 1].tolist()  # same pieces
    ends = np.cumsum(req.chunks[:, 1].astype(np.int64))
    assert (req.chunks[:, 0].astype(np.int64) - scratch.ctypes.data).tolist() == [0] + ends[:-1].tolist()
    with pytest.raises(ValueError, match="at least"):
        IovRequest.scratch_pull(layout, 1, 2, 1.0, runs, scratch[:-1])


@pytest.mark.integration
async def test_link_warms_up_without_touching_the_cache() -> None:
    a, b = storage(seed=9), storage()
    async with linked(a, b) as (ba, bb):
        warmup_pulls = bb.config.warmup_pulls
        await wait_until(lambda: ba.stats()["served"] >= warmup_pulls, 5, 0.01)
        assert ba.stats()["served"] == warmup_pulls  # the owner served the warm-up pulls
        assert torch.count_nonzero(b.kv) == 0  # into scratch, not into the puller's cache
        assert bb.stats()["pulls"] == 0
        await _pull_every_byte(ba, a, bb, b, 10, 1)


@pytest.mark.integration
async def test_failed_warm_up_keeps_the_link(monkeypatch) -> None:
    from xllm_py.kv_transfer.ucx import iov_protocol

    monkeypatch.setattr(iov_protocol, "check_src_runs", lambda runs, n: "peer refused: not now")
    a, b = storage(seed=10), storage()
    async with linked(a, b) as (ba, bb):
        assert bb._peers[ba.address].iov_key is not None
        assert ba.stats()["served"] == 0
        monkeypatch.undo()
        await _pull_every_byte(ba, a, bb, b, 12, 2)


def test_pull_accepts_an_owner_that_also_confirms_with_an_empty_status() -> None:
    from xllm_py.kv_transfer.ucx import ucp_ffi as ffi
    from xllm_py.kv_transfer.ucx.env import import_ucxx
    from xllm_py.kv_transfer.ucx.iov_protocol import OP_PULL, IovLayout, IovRequest, decode_request, pull_task
    from xllm_py.kv_transfer.ucx.iov_worker import KIND_DATA, KIND_STATUS, IovWorker, tag

    import_ucxx()
    s = storage(num_blocks=16, seed=11)
    layout = IovLayout(s)
    holder: list[IovWorker] = []

    def old_owner(_tag: int, msg: bytes):  # DATA, then STATUS("") as owners did before
        _, req_id, _, _, runs, _ = decode_request(msg)
        w = holder[0]

        def make(track: list):
            ep = w.ep_handle("self")
            track += [ffi.tag_send_iov(ep, layout.chunks(runs, 0), tag(KIND_DATA, req_id)),
                      ffi.tag_send_bytes(ep, b"", tag(KIND_STATUS, req_id))]
            yield list(track)
        return make, 5.0, None, "old owner"

    w = IovWorker({"TLS": "sm,self"}, old_owner, name="test-iov-old")
    holder.append(w)
    try:
        w.connect("self", w.address).result(10)
        runs = np.array([[1, 8, 3]], dtype=np.int64)
        req = IovRequest(layout, OP_PULL, 77, 1, 5.0, runs)
        w.start(lambda track: pull_task(track, w.handle, w.ep_handle("self"), req), timeout=10).result(10)
    finally:
        w.close()
    assert torch.equal(s.kv[:, :, 8:11], s.kv[:, :, 1:4])


@contextlib.asynccontextmanager
async def _late_owner(ba):
    """The owner's IovWorker holds every request it gets (``held``) instead of serving it."""
    owner = ba._iov
    serve, held = owner._on_request, []
    owner._on_request = lambda sender_tag, msg: held.append((sender_tag, msg))
    try:
        yield held
    finally:
        owner._on_request = serve


@pytest.mark.integration
async def test_late_answer_to_a_timed_out_pull_is_drained_not_written() -> None:
    from xllm_py.kv_transfer.ucx import ucp_ffi as ffi
    from xllm_py.kv_transfer.ucx.iov_protocol import decode_request
    from xllm_py.kv_transfer.ucx.iov_worker import KIND_DATA, tag

    a, b = storage(seed=12), storage()
    async with linked(a, b) as (ba, bb):
        owner, puller, p = ba._iov, bb._iov, bb._peers[ba.address]
        served = ba.stats()["served"]
        async with _late_owner(ba) as held:
            # (straight to the worker: the public pull also drops the link after a timeout,
            # and the owner then ignores the request instead of answering it late)
            with pytest.raises(TimeoutError):
                await asyncio.wrap_future(bb._iov_path.start(p, "pull", [(0, 0, 40)], 0.3))
        assert len(held) == 1
        assert (puller.num_draining, puller.num_drained) == (2, 0)  # its DATA and STATUS receives
        puller.disconnect(p.iov_key)  # as after a failure: the drains outlive the endpoint
        assert puller.call(lambda: puller.num_draining).result(10) == 2

        owner.call(owner._serve, *held[0])  # the real owner answers now: 40 blocks of DATA
        await wait_until(lambda: puller.num_drained >= 1 and ba.stats()["served"] != served, 10, 0.01)
        assert ba.stats()["served"] == served + 1  # the DATA went out
        assert (puller.num_drained, puller.num_draining) == (1, 1)  # taken by a drain; STATUS's still waits
        assert torch.count_nonzero(b.kv) == 0  # nothing written into the cache
        req_id = decode_request(held[0][1])[1]
        # nothing left in UCX's unexpected queue for that tag
        assert puller.call(ffi.probe_recv, puller.handle, tag(KIND_DATA, req_id), ffi.FULL_MASK).result(10) is None


@pytest.mark.integration
async def test_drain_receives_expire_and_refusals_need_none() -> None:
    from xllm_py.kv_transfer import TransferError

    a, b = storage(seed=13), storage()
    async with linked(a, b) as (ba, bb):
        puller, p = bb._iov, bb._peers[ba.address]
        with pytest.raises(TransferError, match="refused"):  # the owner answers: nothing to drain
            await bb.pull(ba.address, [a.num_blocks + 5], [1], timeout=5)
        assert puller.call(lambda: puller.num_draining).result(10) == 0

        puller.drain_s = 0.2
        async with _late_owner(ba) as held:  # the owner never answers
            with pytest.raises(TimeoutError):
                await asyncio.wrap_future(bb._iov_path.start(p, "pull", [(0, 0, 4)], 0.3))
        assert len(held) == 1
        await wait_until(lambda: not puller.num_draining, 10, 0.01)
        assert (puller.num_draining, puller.num_drains_expired, puller.num_drained) == (0, 2, 0)
        await _pull_every_byte(ba, a, bb, b, 12, 3)  # later requests use fresh tags


@pytest.mark.integration
async def test_a_pull_in_flight_fails_when_the_owner_goes_away() -> None:
    """The owner holds the request, then closes: the puller's pending pull ends with a
    transfer error (the link's close cancels its tasks), not at its 30 s deadline, and
    nothing is written."""
    from xllm_py.kv_transfer.base import TransferError, TransferTimeout

    a, b = storage(seed=14), storage()
    async with linked(a, b) as (ba, bb):
        async with _late_owner(ba) as held:
            pull = asyncio.ensure_future(bb.pull(ba.address, [0, 1, 2], [0, 1, 2], timeout=30))
            await wait_until(lambda: held, 10, 0.01)
            assert len(held) == 1 and not pull.done()
            await ba.close()
            with pytest.raises(TransferError) as err:
                await asyncio.wait_for(pull, 20)  # (well before the pull's own deadline)
        assert not isinstance(err.value, TransferTimeout)
        assert torch.count_nonzero(b.kv) == 0
