"""The Batch API end to end: a 200-line batch file through the openai SDK
(files.create / batches.create / batches.retrieve / files.content) on a service with two
MIX engines, one of them SIGKILLed midway: every line is answered in the output or the
error file, none twice; the bad lines are in the error file, the batch completes."""
from __future__ import annotations

import json
import time

import openai
import pytest

from tests.integration.cluster_harness import Harness, labelled
from tests.waiting import wait_until_sync

pytestmark = pytest.mark.integration

NUM_LINES = 200
EP = "/v1/chat/completions"


def _batch_file() -> tuple[bytes, set[str]]:
    """200 lines: 195 good chat requests and 5 bad ones (their custom ids returned)."""
    lines = [json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": EP, "body": {
        "model": "tiny", "max_tokens": 6, "temperature": 0, "ignore_eos": True,
        "messages": [{"role": "user", "content": f"Question {i}: name a colour."}]}})
        for i in range(NUM_LINES - 5)]
    bad = ["{not json",
           json.dumps({"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings",
                       "body": {"model": "tiny", "input": "x"}}),
           json.dumps({"custom_id": "bad-temp", "method": "POST", "url": EP, "body": {
               "model": "tiny", "temperature": -1,
               "messages": [{"role": "user", "content": "x"}]}}),
           json.dumps({"custom_id": "req-0", "method": "POST", "url": EP, "body": {}}),
           json.dumps({"custom_id": "bad-body", "method": "POST", "url": EP, "body": []})]
    for k, line in enumerate(bad):
        lines.insert(20 + 37 * k, line)
    return ("\n".join(lines) + "\n").encode(), {"bad-url", "bad-temp", "bad-body"}


def test_batch_of_200_survives_an_engine_killed_midway(etcd_server, tmp_path):
    h = Harness(etcd_server.endpoint, "batch-api/", tmp_path)
    try:
        svc = h.service(extra=["--batch-dir", str(tmp_path / "batches")])
        engines = [h.engine("MIX", f"mix-{i}") for i in range(2)]
        for e in engines:
            e.wait_ready(180)
        svc.wait_ready(60, path="/readiness")
        wait_until_sync(lambda: labelled(svc.http_url, "xllm_service_instances",
                                         'state="ACTIVE"') == 2, 30)
        c = openai.OpenAI(base_url=svc.http_url + "/v1", api_key="x", max_retries=2,
                          timeout=60)
        data, bad_ids = _batch_file()
        f = c.files.create(file=("batch.jsonl", data), purpose="batch")
        assert f.purpose == "batch" and f.bytes == len(data)
        batch = c.batches.create(input_file_id=f.id, endpoint=EP, completion_window="24h")
        assert batch.status in ("validating", "in_progress")
        t0 = time.monotonic()
        wait_until_sync(lambda: (c.batches.retrieve(batch.id).request_counts or
                            batch.request_counts).completed >= 40, 90, step_s=0.2)
        engines[0].kill()
        killed_at = c.batches.retrieve(batch.id).request_counts.completed
        wait_until_sync(lambda: c.batches.retrieve(batch.id).status == "completed", 150, step_s=0.5)
        done = c.batches.retrieve(batch.id)
        print(f"\nbatch of {NUM_LINES}: engine killed at {killed_at} answered, completed in "
              f"{time.monotonic() - t0:.1f}s, counts {done.request_counts}")
        out = [json.loads(x) for x in c.files.content(done.output_file_id).text.splitlines()]
        err = [json.loads(x) for x in c.files.content(done.error_file_id).text.splitlines()]
        assert len(out) + len(err) == NUM_LINES  # every line answered, none twice
        ids = [r["custom_id"] for r in out + err if r["custom_id"] is not None]
        assert len(ids) == len(set(ids)) + 1  # only the repeated "req-0" line twice...
        assert sum(1 for r in err if r["error"]["code"] == "duplicate_custom_id") == 1
        assert sorted(r["custom_id"] for r in out) == sorted(f"req-{i}" for i in range(195))
        assert all(r["response"]["status_code"] == 200 and
                   r["response"]["body"]["choices"][0]["message"]["content"] is not None
                   for r in out)
        assert {r["custom_id"] for r in err} - {None, "req-0"} == bad_ids
        assert (done.request_counts.total, done.request_counts.completed,
                done.request_counts.failed) == (NUM_LINES, 195, 5)
        assert c.batches.list().data[0].id == batch.id
        with pytest.raises(openai.ConflictError):
            c.batches.cancel(batch.id)
    finally:
        h.stop()


def test_batch_api_refuses_bad_requests(etcd_server, tmp_path):
    h = Harness(etcd_server.endpoint, "batch-bad/", tmp_path)
    try:
        svc = h.service(extra=["--batch-dir", str(tmp_path / "b")])
        svc.wait_ready(60)
        c = openai.OpenAI(base_url=svc.http_url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="purpose"):
            c.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")
        with pytest.raises(openai.BadRequestError, match="input_file_id"):
            c.batches.create(input_file_id="file-nope", endpoint=EP, completion_window="24h")
        f = c.files.create(file=("x.jsonl", b"{}\n"), purpose="batch")
        with pytest.raises(openai.BadRequestError, match="endpoint"):
            c.batches.create(input_file_id=f.id, endpoint="/v1/embeddings",
                             completion_window="24h")
        with pytest.raises(openai.NotFoundError):
            c.batches.retrieve("batch_" + "0" * 24)
        with pytest.raises(openai.NotFoundError):
            c.files.content("file-" + "0" * 24)
    finally:
        h.stop()
