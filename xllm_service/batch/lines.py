"""One line of a batch input file: `{"custom_id", "method", "url", "body"}`.

`parse_line` returns the request to run, or the error record that answers the line
(unreadable JSON, a missing or repeated custom_id, another method, a url that is not the
batch's endpoint, a body that is not an object): a bad line never fails the batch.
`output_record` / `error_record` are the lines of the output and error files (OpenAI's
shape: `{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`).
"""
from __future__ import annotations

import dataclasses
import json
import uuid


@dataclasses.dataclass
class BatchLine:
    number: int  # 0-based line of the input file
    custom_id: str
    body: dict


def _record_id() -> str:
    return f"batch_req_{uuid.uuid4().hex[:24]}"


def output_record(custom_id: str, status_code: int, body: object) -> dict:
    return {"id": _record_id(), "custom_id": custom_id,
            "response": {"status_code": status_code, "request_id": _record_id(), "body": body},
            "error": None}


def error_record(custom_id: str | None, code: str, message: str,
                 status_code: int | None = None, body: object = None) -> dict:
    response = None
    if status_code is not None:
        response = {"status_code": status_code, "request_id": _record_id(), "body": body}
    return {"id": _record_id(), "custom_id": custom_id, "response": response,
            "error": {"code": code, "message": message}}


def parse_line(number: int, text: str, endpoint: str,
               seen: set[str]) -> BatchLine | dict:
    """The line's request, or the error record answering it (`seen`: custom ids so far)."""
    try:
        item = json.loads(text)
    except ValueError as exc:
        return error_record(None, "invalid_json", f"line {number + 1} is not JSON: {exc}")
    if not isinstance(item, dict):
        return error_record(None, "invalid_request", f"line {number + 1} is not a JSON object")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return error_record(None, "invalid_request",
                            f"line {number + 1}: custom_id must be a non-empty string")
    if custom_id in seen:
        return error_record(custom_id, "duplicate_custom_id",
                            f"line {number + 1}: custom_id {custom_id!r} is used before")
    seen.add(custom_id)
    if item.get("method", "POST") != "POST":
        return error_record(custom_id, "invalid_request",
                            f"line {number + 1}: method must be POST")
    if item.get("url") != endpoint:
        return error_record(custom_id, "invalid_url",
                            f"line {number + 1}: url must be the batch's endpoint {endpoint}, "
                            f"got {item.get('url')!r}")
    body = item.get("body")
    if not isinstance(body, dict):
        return error_record(custom_id, "invalid_request",
                            f"line {number + 1}: body must be a JSON object")
    return BatchLine(number, custom_id, body)


def input_lines(data: bytes) -> list[str]:
    """The non-blank lines of an input file (raises UnicodeDecodeError if not UTF-8)."""
    return [line for line in data.decode("utf-8").splitlines() if line.strip()]
