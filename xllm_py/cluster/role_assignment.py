"""RoleAssignment: the duty the master gives an elastic instance (one started MIX in a
cluster), kept in etcd beside its registration: `XLLM:ROLE:<name>` = JSON
{"role": "PREFILL" | "DECODE" | "MIX", "epoch": N, "pinned": bool}.

The key is in etcd, not in the master's memory, so every service replica and a newly
elected master read the same assignments, and a restarted master continues from them.
It has no lease: an assignment outlives the master that wrote it and the instance's
restarts (a restarted instance takes its duty back at once). The engine acknowledges
an assignment by publishing its epoch and duty in its own registration
(`InstanceMeta.duty`, `duty_epoch`), which every replica watches and routes by.

`pinned`: an operator's assignment (written with etcdctl or `put_assignment(...,
pinned=True)`): the master never changes it.
"""
from __future__ import annotations

import dataclasses
import json

from xllm_py.config import InstanceRole

ROLE_PREFIX = "XLLM:ROLE:"
ASSIGNABLE = (InstanceRole.PREFILL, InstanceRole.DECODE, InstanceRole.MIX)


def role_key(name: str) -> str:
    return f"{ROLE_PREFIX}{name}"


def name_of_role_key(key: str) -> str | None:
    if not key.startswith(ROLE_PREFIX):
        return None
    return key[len(ROLE_PREFIX):] or None


class RoleAssignmentError(ValueError):
    """A value under XLLM:ROLE: that is not an assignment."""


@dataclasses.dataclass(frozen=True)
class RoleAssignment:
    role: InstanceRole
    epoch: int
    pinned: bool = False

    def __post_init__(self) -> None:
        if self.role not in ASSIGNABLE:
            raise RoleAssignmentError(f"role {self.role.value} cannot be assigned; "
                                      "expected PREFILL, DECODE or MIX")
        if self.epoch < 0:
            raise RoleAssignmentError(f"epoch must be >= 0, got {self.epoch}")

    def to_json(self) -> str:
        return json.dumps({"role": self.role.value, "epoch": self.epoch,
                           "pinned": self.pinned})

    @classmethod
    def from_json(cls, value: str | bytes) -> "RoleAssignment":
        try:
            data = json.loads(value)
            role = InstanceRole.parse(str(data["role"]))
            epoch = int(data.get("epoch", 0))
        except (ValueError, KeyError, TypeError) as exc:
            raise RoleAssignmentError(f"not a role assignment: {exc}") from None
        return cls(role, epoch, bool(data.get("pinned", False)))
