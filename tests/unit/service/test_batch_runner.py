"""The Batch API's pieces without a cluster: the batch state table, input lines, and the
runner over a fake executor in a temporary directory (lines retried on 5xx, bad lines to
the error file, a cancel, and a master failover mid-batch: every line answered once)."""
from __future__ import annotations

import asyncio
import itertools
import json

import pytest

from xllm_service.batch import runner as runner_mod
from xllm_service.batch.files import FileStore
from xllm_service.batch.lines import BatchLine, parse_line
from xllm_service.batch.runner import BatchRunner
from xllm_service.batch.state import _ALLOWED, BatchRecord, BatchStatus
from xllm_service.batch.store import BatchStore, new_batch_id

B = BatchStatus
EDGES = {(B.VALIDATING, B.IN_PROGRESS), (B.VALIDATING, B.FAILED), (B.VALIDATING, B.CANCELLING),
         (B.IN_PROGRESS, B.FINALIZING), (B.IN_PROGRESS, B.CANCELLING),
         (B.IN_PROGRESS, B.EXPIRED), (B.FINALIZING, B.COMPLETED),
         (B.CANCELLING, B.CANCELLED)}
EP = "/v1/completions"


@pytest.mark.parametrize("old, new", sorted(itertools.product(B, B)))
def test_every_batch_edge(old, new):
    record = BatchRecord(id="batch_x", input_file_id="f", endpoint=EP, status=old)
    if (old, new) in EDGES:
        record.transition(new)
        assert record.status is new
    else:
        with pytest.raises(ValueError):
            record.transition(new)
    assert set(_ALLOWED) == set(B)


def test_bad_lines_are_answered_by_an_error_record():
    seen: set[str] = set()
    good = parse_line(0, json.dumps({"custom_id": "a", "method": "POST", "url": EP,
                                     "body": {"prompt": "x"}}), EP, seen)
    assert isinstance(good, BatchLine) and good.custom_id == "a"
    cases = ["{not json", "[1]", json.dumps({"url": EP, "body": {}}),
             json.dumps({"custom_id": "a", "url": EP, "body": {}}),  # repeated id
             json.dumps({"custom_id": "b", "url": "/v1/embeddings", "body": {}}),
             json.dumps({"custom_id": "c", "method": "GET", "url": EP, "body": {}}),
             json.dumps({"custom_id": "d", "url": EP, "body": "x"})]
    codes = [parse_line(i + 1, text, EP, seen)["error"]["code"] for i, text in enumerate(cases)]
    assert codes == ["invalid_json", "invalid_request", "invalid_request",
                     "duplicate_custom_id", "invalid_url", "invalid_request", "invalid_request"]


def _input(n: int, bad: int = 0) -> bytes:
    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": EP,
                         "body": {"prompt": f"p{i}", "max_tokens": 2}}) for i in range(n)]
    lines += ["{broken"] * bad
    return ("\n".join(lines) + "\n").encode()


def _batch(tmp_path, data: bytes):
    files, store = FileStore(tmp_path), BatchStore(tmp_path)
    fid = files.create(data, "in.jsonl", "batch")["id"]
    record = BatchRecord(id=new_batch_id(), input_file_id=fid, endpoint=EP)
    store.save(record)
    return files, store, record.id


def _answers(files, store, batch_id):
    record = store.get(batch_id)
    out = [] if record.output_file_id is None else [
        json.loads(x) for x in files.content(record.output_file_id).splitlines()]
    err = [] if record.error_file_id is None else [
        json.loads(x) for x in files.content(record.error_file_id).splitlines()]
    return record, out, err


@pytest.fixture(autouse=True)
def _fast(monkeypatch):
    monkeypatch.setattr(runner_mod, "BACKOFF_S", (0.001, 0.002))
    monkeypatch.setattr(runner_mod, "POLL_S", 0.01)


async def test_lines_run_offline_retried_on_5xx_and_bad_lines_go_to_the_error_file(tmp_path):
    files, store, bid = _batch(tmp_path, _input(20, bad=2))
    calls: dict[str, int] = {}

    async def execute(endpoint, body):
        assert endpoint == EP and body["offline"] is True and body["stream"] is False
        calls[body["prompt"]] = calls.get(body["prompt"], 0) + 1
        if body["prompt"] == "p3" and calls["p3"] < 3:
            return 503, {"error": {"message": "engine lost"}}
        if body["prompt"] == "p7":
            return 400, {"error": {"message": "bad temperature"}}
        return 200, {"choices": [{"text": body["prompt"]}]}

    await BatchRunner(store, files, execute, lambda: True).run(bid)
    record, out, err = _answers(files, store, bid)
    assert record.status is B.COMPLETED and (record.completed, record.failed) == (19, 3)
    assert record.to_api()["request_counts"] == {"total": 22, "completed": 19, "failed": 3}
    assert calls["p3"] == 3
    assert [o["custom_id"] for o in out] == [f"r{i}" for i in range(20) if i != 7]
    assert all(o["response"]["status_code"] == 200 for o in out)
    assert [e["custom_id"] for e in err] == ["r7", None, None]
    assert err[0]["response"]["status_code"] == 400 and "bad temperature" in err[0]["error"]["message"]


async def test_a_new_master_finishes_the_batch_and_answers_every_line_once(tmp_path):
    files, store, bid = _batch(tmp_path, _input(40))
    first_master = [True]
    gate = asyncio.Event()

    async def slow_after_ten(endpoint, body):
        if int(body["prompt"][1:]) >= 10:
            await gate.wait()  # in flight when the master goes
        return 200, {"choices": [{"text": body["prompt"]}]}

    old = BatchRunner(store, files, slow_after_ten, lambda: first_master[0], concurrency=16)
    task = asyncio.create_task(old.run(bid))
    while len(store.answered(bid)) < 10:
        await asyncio.sleep(0.01)
    first_master[0] = False  # the master's lease is gone
    gate.set()  # its in-flight lines answer now: it must not journal them
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(store.answered(bid)) < 40 and store.get(bid).status is B.IN_PROGRESS
    ran = []

    async def execute(endpoint, body):
        ran.append(body["prompt"])
        return 200, {"choices": [{"text": body["prompt"]}]}

    new = BatchRunner(store, files, execute, lambda: True)
    new.poll()  # picks the open batch up from the directory
    await asyncio.gather(*new._tasks.values())
    record, out, err = _answers(files, store, bid)
    assert record.status is B.COMPLETED and err == []
    assert sorted(o["custom_id"] for o in out) == sorted(f"r{i}" for i in range(40))
    assert not set(ran) & {f"p{i}" for i in range(10)}  # journaled lines are not rerun


async def test_cancel_keeps_what_was_answered(tmp_path):
    files, store, bid = _batch(tmp_path, _input(30))
    gate = asyncio.Event()

    async def execute(endpoint, body):
        if int(body["prompt"][1:]) >= 5:
            await gate.wait()
        return 200, {}

    task = asyncio.create_task(BatchRunner(store, files, execute, lambda: True,
                                           concurrency=30).run(bid))
    while len(store.answered(bid)) < 5:
        await asyncio.sleep(0.01)
    store.request_cancel(bid)
    await asyncio.wait_for(task, 5)
    record, out, err = _answers(files, store, bid)
    assert record.status is B.CANCELLED and len(out) == 5 and record.cancelled_at


async def test_a_missing_input_file_fails_the_batch(tmp_path):
    files, store = FileStore(tmp_path), BatchStore(tmp_path)
    record = BatchRecord(id=new_batch_id(), input_file_id="file-" + "0" * 24, endpoint=EP)
    store.save(record)

    async def execute(endpoint, body):
        raise AssertionError("nothing to run")

    await BatchRunner(store, files, execute, lambda: True).run(record.id)
    failed = store.get(record.id)
    assert failed.status is B.FAILED and failed.errors[0]["code"] == "invalid_file"


def test_a_torn_journal_line_is_run_again_and_a_repeated_one_read_once(tmp_path):
    store = BatchStore(tmp_path)
    store.append("batch_x", 0, "output", {"a": 1})
    store.append("batch_x", 0, "output", {"a": 2})
    with open(store.root / "batch_x.journal.jsonl", "ab") as f:
        f.write(b'{"line": 1, "kind": "out')
    assert store.answered("batch_x") == {0: ("output", {"a": 1})}
