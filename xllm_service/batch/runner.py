"""BatchRunner: the master service runs every open batch's lines as offline requests.

Stages of a batch (state.py), each step saved before the next:
  validating: the input file read (missing, or not UTF-8: failed) -> in_progress, total
  = its request lines -> every line not in the journal yet (store.py): a bad line is
  answered by its error record at once; a good one is sent through the service's own
  OpenAI app (in process, `asgi_executor`) with `"offline": true` (and never streamed),
  at most `concurrency` at a time; 429 / 5xx / no answer (an engine lost, no instance
  for a moment) is retried with backoff up to MAX_ATTEMPTS, so the service routes it to
  another engine; every other answer is final: 200 to the output file, the rest to the
  error file -> when every line is answered: finalizing (the output and error files
  written in input order) -> completed.
  A cancel (the API drops a marker file, from any service) stops new lines and the ones
  running -> cancelled, the files holding what was answered; past `expires_at`: expired.
Failover: only the master runs batches (`is_master`, the etcd election). A service that
becomes master picks every open batch up from the directory, skips the journaled lines
and runs the others; a line that was running on the old master runs again, and is
answered once (the journal keeps the first answer). A runner that stops being master
stops its batches without journaling what is in flight.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Awaitable, Callable

from xllm_service.batch.files import FileStore
from xllm_service.batch.lines import BatchLine, error_record, input_lines, output_record, parse_line
from xllm_service.batch.state import BatchRecord, BatchStatus
from xllm_service.batch.store import BatchStore

logger = logging.getLogger(__name__)

B = BatchStatus
# (status code, JSON body) of one request through the service's app.
Executor = Callable[[str, dict], Awaitable[tuple[int, object]]]
MAX_ATTEMPTS = 10
BACKOFF_S = (0.5, 4.0)  # first, largest
RETRY_STATUS = {408, 429, 500, 502, 503, 504}
CONCURRENCY = 128
POLL_S = 0.5


def asgi_executor(app, api_key: str | None = None) -> tuple[Executor, Callable[[], Awaitable]]:
    """Requests through `app` in this process (no socket): the same validation, routing
    and errors as a client's. Returns (execute, close)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://batch",
                               headers=headers, timeout=600.0)

    async def execute(endpoint: str, body: dict) -> tuple[int, object]:
        r = await client.post(endpoint, json=body)
        try:
            return r.status_code, r.json()
        except ValueError:
            return r.status_code, r.text

    return execute, client.aclose


class BatchRunner:
    def __init__(self, store: BatchStore, files: FileStore, execute: Executor,
                 is_master: Callable[[], bool], concurrency: int = CONCURRENCY) -> None:
        self.store = store
        self.files = files
        self.execute = execute
        self.is_master = is_master
        self.concurrency = concurrency
        self._tasks: dict[str, asyncio.Task] = {}

    async def loop(self) -> None:
        while True:
            try:
                self.poll()
            except Exception:
                logger.exception("batch poll failed")
            await asyncio.sleep(POLL_S)

    def poll(self) -> None:
        """Start a task for every open batch (master only)."""
        if not self.is_master():
            return
        for record in self.store.list():
            if not record.status.is_final and record.id not in self._tasks:
                task = asyncio.create_task(self.run(record.id))
                self._tasks[record.id] = task
                task.add_done_callback(lambda t, bid=record.id: self._tasks.pop(bid, None))

    async def stop(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    # ------------------------------------------------------------------ one batch
    async def run(self, batch_id: str) -> None:
        record = self.store.get(batch_id)
        if record is None or record.status.is_final:
            return
        lines = self._read_input(record)
        if record.status is B.VALIDATING:
            if self.store.cancel_requested(batch_id):
                record.transition(B.CANCELLING)
            elif lines is None:
                record.transition(B.FAILED)
                self.store.save(record)
                return
            else:
                record.total = len(lines)
                record.transition(B.IN_PROGRESS)
            self.store.save(record)
        if record.status is B.IN_PROGRESS and lines is not None:
            await self._run_lines(record, lines)
        if record.status is B.IN_PROGRESS and time.time() > record.expires_at:
            self._finalize(record)  # -> expired
        elif record.status is B.IN_PROGRESS:  # every line answered
            record.transition(B.FINALIZING)
            self.store.save(record)
        if record.status in (B.FINALIZING, B.CANCELLING):
            self._finalize(record)

    def _read_input(self, record: BatchRecord) -> list[str] | None:
        data = self.files.content(record.input_file_id)
        error = None
        if data is None:
            error = f"input file {record.input_file_id} is not there"
        else:
            try:
                return input_lines(data)
            except UnicodeDecodeError:
                error = "the input file is not UTF-8 text"
        record.errors = [{"code": "invalid_file", "message": error, "line": None}]
        return None

    async def _run_lines(self, record: BatchRecord, lines: list[str]) -> None:
        answered = self.store.answered(record.id)
        record.completed = sum(1 for k, _ in answered.values() if k == "output")
        record.failed = len(answered) - record.completed
        seen: set[str] = set()
        todo: list[BatchLine] = []
        for number, text in enumerate(lines):
            parsed = parse_line(number, text, record.endpoint, seen)
            if number in answered:
                continue
            if isinstance(parsed, dict):
                self._answer(record, number, "error", parsed)
            else:
                todo.append(parsed)
        sem = asyncio.Semaphore(self.concurrency)
        tasks = [asyncio.create_task(self._run_line(record, line, sem)) for line in todo]
        try:
            while tasks and not all(t.done() for t in tasks):
                await asyncio.wait(tasks, timeout=POLL_S)
                self.store.save(record)  # request counts, for /v1/batches readers
                if not self.is_master():
                    logger.warning("batch %s: no longer master, stopping", record.id)
                    raise asyncio.CancelledError
                if self.store.cancel_requested(record.id) or time.time() > record.expires_at:
                    if self.store.cancel_requested(record.id):
                        record.transition(B.CANCELLING)
                    break
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _run_line(self, record: BatchRecord, line: BatchLine,
                        sem: asyncio.Semaphore) -> None:
        body = {**line.body, "offline": True, "stream": False}
        body.pop("stream_options", None)
        async with sem:
            status, answer = 0, None
            for attempt in range(MAX_ATTEMPTS):
                try:
                    status, answer = await self.execute(record.endpoint, body)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # the app itself failed: like a 500
                    status, answer = 500, {"error": {"message": repr(exc)}}
                if status not in RETRY_STATUS:
                    break
                await asyncio.sleep(min(BACKOFF_S[1], BACKOFF_S[0] * 2 ** attempt))
        if not self.is_master():
            return  # the new master runs it
        if status == 200:
            self._answer(record, line.number, "output",
                         output_record(line.custom_id, status, answer))
        else:
            message = _error_message(answer) or f"HTTP {status}"
            self._answer(record, line.number, "error", error_record(
                line.custom_id, "server_error" if status >= 500 or status == 429
                else "invalid_request", message, status, answer))

    def _answer(self, record: BatchRecord, number: int, kind: str, rec: dict) -> None:
        self.store.append(record.id, number, kind, rec)
        if kind == "output":
            record.completed += 1
        else:
            record.failed += 1

    def _finalize(self, record: BatchRecord) -> None:
        """The output and error files from the journal, in input order; the final status."""
        answered = self.store.answered(record.id)
        out, err = [], []
        for number in sorted(answered):
            kind, rec = answered[number]
            (out if kind == "output" else err).append(json.dumps(rec))
        if out:
            record.output_file_id = self.files.create(
                ("\n".join(out) + "\n").encode(), f"{record.id}_output.jsonl",
                "batch_output")["id"]
        if err:
            record.error_file_id = self.files.create(
                ("\n".join(err) + "\n").encode(), f"{record.id}_error.jsonl",
                "batch_output")["id"]
        record.completed, record.failed = len(out), len(err)
        final = {B.FINALIZING: B.COMPLETED, B.CANCELLING: B.CANCELLED,
                 B.IN_PROGRESS: B.EXPIRED}[record.status]
        record.transition(final)
        self.store.save(record)
        logger.info("batch %s %s: %d answered, %d errors", record.id, final.value,
                    len(out), len(err))


def _error_message(answer: object) -> str:
    if isinstance(answer, dict) and isinstance(answer.get("error"), dict):
        return str(answer["error"].get("message") or "")
    return ""
