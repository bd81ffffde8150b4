"""FileStore: the files of the Batch API (/v1/files), one directory on disk.

Each file is `<id>.data` (its bytes) and `<id>.json` (its OpenAI file object: id, bytes,
created_at, filename, purpose), both written to a temporary name and renamed, so a reader
never sees half a file. Ids are `file-<hex>`.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import time
import uuid

_ID = re.compile(r"^file-[0-9a-f]{24}$")


def write_atomic(path: pathlib.Path, data: bytes) -> None:
    """`data` at `path`, whole or not at all (a temporary file renamed over it)."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class FileStore:
    def __init__(self, root: pathlib.Path) -> None:
        self.root = pathlib.Path(root) / "files"
        self.root.mkdir(parents=True, exist_ok=True)

    def create(self, data: bytes, filename: str, purpose: str) -> dict:
        file_id = f"file-{uuid.uuid4().hex[:24]}"
        meta = {"id": file_id, "object": "file", "bytes": len(data),
                "created_at": int(time.time()), "filename": filename, "purpose": purpose,
                "status": "processed"}
        write_atomic(self.root / f"{file_id}.data", data)
        write_atomic(self.root / f"{file_id}.json", json.dumps(meta).encode())
        return meta

    def get(self, file_id: str) -> dict | None:
        if not _ID.match(file_id):
            return None
        try:
            return json.loads((self.root / f"{file_id}.json").read_text())
        except (OSError, ValueError):
            return None

    def content(self, file_id: str) -> bytes | None:
        if self.get(file_id) is None:
            return None
        try:
            return (self.root / f"{file_id}.data").read_bytes()
        except OSError:
            return None
