"""Value checks of the HTTP request models (protocol.py): strict JSON parsing into a
model with errors that name the parameter, and the wire fit of every value: each integer
fits its proto field (`_WIRE_INT_BITS`: seed int64, the others int32), each number is
finite and fits a proto float (a value that does not would fail later in the service's
conversion, as a 500)."""
from __future__ import annotations

import math
from typing import Any, TypeVar

import pydantic
from pydantic import BaseModel

from xllm_py.api.errors import InvalidRequestError

# Widths of the integer fields as they travel in xllm.proto (DisaggRequest); a field not
# named here is an int32.
_WIRE_INT_BITS = {"seed": 64}
_FLOAT32_MAX = 3.4028234663852886e38


_M = TypeVar("_M", bound=BaseModel)


def parse_model(cls: type[_M], body: bytes) -> _M:
    """JSON body -> any pydantic model, strictly typed; errors -> InvalidRequestError."""
    try:
        return cls.model_validate_json(body or b"", strict=True)
    except pydantic.ValidationError as e:
        raise validation_error(e) from None


def validation_error(e: pydantic.ValidationError) -> InvalidRequestError:
    errors = e.errors(include_url=False)
    if not errors:
        return InvalidRequestError("invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return InvalidRequestError(f"malformed JSON body: {first.get('msg', '')}")
    if first.get("type") == "model_type" or not first.get("loc"):
        return InvalidRequestError("request body must be a JSON object")
    # Union members add their type names to loc; keep the field path only.
    loc = [str(x) for x in first["loc"] if isinstance(x, int) or not _is_type_tag(str(x))]
    param = ".".join(loc) if loc else None
    return InvalidRequestError(f"{param}: {first.get('msg', 'invalid value')}", param=param)


def _is_type_tag(s: str) -> bool:
    return any(c in s for c in "[]") or s in {"str", "int", "float", "bool", "list", "dict"}


def check_wire_values(req: BaseModel) -> None:
    """Every integer fits its proto field, every number is finite and fits a proto float
    (a value that does not would fail later in the service's conversion, as a 500)."""
    from xllm_py.api.structured_request import STRUCTURED_FIELDS  # (they travel as text)

    for name in type(req).model_fields:
        if name in STRUCTURED_FIELDS:
            continue
        value = getattr(req, name)
        if value is None or isinstance(value, (str, bool, BaseModel)):
            continue
        bits = _WIRE_INT_BITS.get(name, 32)
        bad = _first_unfit(value, bits)
        if bad is not None:
            if isinstance(bad, float):
                raise InvalidRequestError(
                    f"{name}: {bad!r} does not fit a 32-bit float", param=name)
            raise InvalidRequestError(
                f"{name}: {bad} does not fit a {bits}-bit signed integer", param=name)


def _first_unfit(value: Any, bits: int) -> int | float | None:
    if isinstance(value, bool) or isinstance(value, str):
        return None
    if isinstance(value, int):
        lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
        return None if lo <= value <= hi else value
    if isinstance(value, float):
        return None if math.isfinite(value) and abs(value) <= _FLOAT32_MAX else value
    if isinstance(value, dict):
        for k, v in value.items():
            if isinstance(k, str) and k.strip().lstrip("-").isdigit():
                k = int(k)  # a JSON key that is a token id (logit_bias) travels as an int32
            bad = _first_unfit(k, bits)
            if bad is None:
                bad = _first_unfit(v, bits)
            if bad is not None:
                return bad
        return None
    if isinstance(value, (list, tuple)):
        if value and isinstance(value[0], int) and not isinstance(value[0], bool):
            lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
            if all(isinstance(v, int) for v in value):  # token ids: one pass in C
                if lo <= min(value) and max(value) <= hi:
                    return None
        for v in value:
            bad = _first_unfit(v, bits)
            if bad is not None:
                return bad
    return None


def check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(message, param=param)
