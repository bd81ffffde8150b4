"""A batch's status (OpenAI's states) and its transition table; BatchRecord, what
/v1/batches returns.

    validating --> in_progress --> finalizing --> completed
        |              |    \\
        v              |     +--> expired (completion window passed; finished lines kept)
      failed           v
                   cancelling --> cancelled (finished lines kept in the files)
    validating --> cancelling also (cancelled before it started)

`failed`: the input file is missing or is not JSONL at all (a bad line never fails the
batch: it goes to the error file). Every change goes through `BatchRecord.transition`.
"""
from __future__ import annotations

import dataclasses
import enum
import time


class BatchStatus(str, enum.Enum):
    VALIDATING = "validating"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    FAILED = "failed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"

    @property
    def is_final(self) -> bool:
        return not _ALLOWED[self]


B = BatchStatus
_ALLOWED: dict[BatchStatus, set[BatchStatus]] = {
    B.VALIDATING: {B.IN_PROGRESS, B.FAILED, B.CANCELLING},
    B.IN_PROGRESS: {B.FINALIZING, B.CANCELLING, B.EXPIRED},
    B.FINALIZING: {B.COMPLETED},
    B.CANCELLING: {B.CANCELLED},
    B.COMPLETED: set(),
    B.FAILED: set(),
    B.EXPIRED: set(),
    B.CANCELLED: set(),
}
# The timestamp field each status sets when entered.
_STAMP = {B.IN_PROGRESS: "in_progress_at", B.FINALIZING: "finalizing_at",
          B.COMPLETED: "completed_at", B.FAILED: "failed_at", B.EXPIRED: "expired_at",
          B.CANCELLING: "cancelling_at", B.CANCELLED: "cancelled_at"}
ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
COMPLETION_WINDOW_S = {"24h": 24 * 3600}


@dataclasses.dataclass
class BatchRecord:
    id: str
    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    status: BatchStatus = B.VALIDATING
    created_at: int = dataclasses.field(default_factory=lambda: int(time.time()))
    expires_at: int = 0
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    total: int = 0
    completed: int = 0
    failed: int = 0
    errors: list[dict] | None = None  # why the batch failed (not a line's error)
    metadata: dict | None = None

    def __post_init__(self) -> None:
        self.status = BatchStatus(self.status)
        if not self.expires_at:
            self.expires_at = self.created_at + COMPLETION_WINDOW_S[self.completion_window]

    def transition(self, new: BatchStatus) -> None:
        if new not in _ALLOWED[self.status]:
            raise ValueError(f"batch {self.id}: {self.status.value} -> {new.value} is not allowed")
        self.status = new
        setattr(self, _STAMP[new], int(time.time()))

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "status": self.status.value}

    @classmethod
    def from_json(cls, data: dict) -> "BatchRecord":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def to_api(self) -> dict:
        """The OpenAI batch object."""
        out = self.to_json()
        for key in ("total", "completed", "failed"):
            out.pop(key)
        out["object"] = "batch"
        out["request_counts"] = {"total": self.total, "completed": self.completed,
                                 "failed": self.failed}
        out["errors"] = ({"object": "list", "data": self.errors} if self.errors else None)
        return out
