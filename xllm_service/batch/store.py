"""BatchStore: batch records and their journals, one directory on disk.

  <root>/batches/<id>.json            the BatchRecord (written whole: temp file + rename)
  <root>/batches/<id>.cancel          a cancel asked for (by any service; the runner acts)
  <root>/batches/<id>.journal.jsonl   one line per answered input line:
                                      {"line": n, "kind": "output" | "error", "record": ...}
                                      appended and fsynced as each line is answered

The journal is what makes a batch survive its master: a service that takes over reads
it, skips the lines answered there and runs the others. A torn last line (the writer died
mid-write) is ignored, so that line runs again; a line journaled twice (two services
both running it while the master changed hands) is read once: the first record wins.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import threading
import uuid

from xllm_service.batch.files import write_atomic
from xllm_service.batch.state import BatchRecord

_ID = re.compile(r"^batch_[0-9a-f]{24}$")


def new_batch_id() -> str:
    return f"batch_{uuid.uuid4().hex[:24]}"


class BatchStore:
    def __init__(self, root: pathlib.Path) -> None:
        self.root = pathlib.Path(root) / "batches"
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def save(self, record: BatchRecord) -> None:
        write_atomic(self.root / f"{record.id}.json", json.dumps(record.to_json()).encode())

    def get(self, batch_id: str) -> BatchRecord | None:
        if not _ID.match(batch_id):
            return None
        try:
            return BatchRecord.from_json(json.loads((self.root / f"{batch_id}.json").read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def list(self) -> list[BatchRecord]:
        """Every batch, newest first."""
        records = [self.get(p.name[:-len(".json")]) for p in self.root.glob("batch_*.json")]
        return sorted((r for r in records if r is not None), key=lambda r: (-r.created_at, r.id))

    def request_cancel(self, batch_id: str) -> None:
        write_atomic(self.root / f"{batch_id}.cancel", b"")

    def cancel_requested(self, batch_id: str) -> bool:
        return (self.root / f"{batch_id}.cancel").exists()

    # -- the journal ------------------------------------------------------------------
    def _journal(self, batch_id: str) -> pathlib.Path:
        return self.root / f"{batch_id}.journal.jsonl"

    def append(self, batch_id: str, line: int, kind: str, record: dict) -> None:
        data = (json.dumps({"line": line, "kind": kind, "record": record}) + "\n").encode()
        with self._lock, open(self._journal(batch_id), "ab") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def answered(self, batch_id: str) -> dict[int, tuple[str, dict]]:
        """Line number -> (kind, record) of every line answered so far (first wins)."""
        out: dict[int, tuple[str, dict]] = {}
        try:
            raw = self._journal(batch_id).read_bytes()
        except FileNotFoundError:
            return out
        for text in raw.splitlines():
            try:
                entry = json.loads(text)
                line, kind, record = int(entry["line"]), entry["kind"], entry["record"]
            except (ValueError, KeyError, TypeError):
                continue  # torn by a writer that died: that line runs again
            out.setdefault(line, (kind, record))
        return out
