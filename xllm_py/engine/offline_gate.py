"""OfflineGate: how many offline tokens a step may carry beside online work.

Offline (batch) requests run only in the room online requests leave. Seats, the token
budget and KV are counted by the scheduler itself; this gate adds the time: while an
online stream with a TPOT target is decoding, offline tokens ride its steps only as long
as those steps stay within the target. The gate measures the interval between
consecutive steps that carried online decodes (what an online stream waits per token) and
adjusts its allowance of offline tokens per step, additive increase while the interval is
under LOW x target, halved when it passes HIGH x target (xLLM's PD OOC pulls offline work
while the last decode step is under 0.9 x its TPOT target, `check_able_to_pull`).

    no online work here             -> no limit (offline work runs at full batch)
    online work, no TPOT target     -> no limit beyond seats, budget and KV
    online work with a target T     -> `allowed` tokens a step, adjusted step by step

The target is the smallest TPOT target of the running online requests (their
`tpot_slo_ms`), else the engine's `prompt_tpot_target_ms`; 0: none.

Pure Python, no torch. The scheduler calls `begin_step` at each schedule() with the
target in force, asks `limit`, and says with `carried` whether the step had online decodes.
"""
from __future__ import annotations

import math

# Interval / target above which the allowance is halved, below which it grows.
HIGH = 0.9
LOW = 0.75


class OfflineGate:
    def __init__(self, max_tokens: int) -> None:
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        self.max_tokens = max_tokens
        self.allowed = 0  # offline tokens a step beside online streams with a target
        self.last_interval_s: float | None = None  # between the last two online steps
        self._began_s: float | None = None
        self._online_step = False  # the step under way carries online decodes

    def begin_step(self, now_s: float, target_s: float | None) -> None:
        """A step begins at `now_s`; the previous one carried online decodes if `carried`
        said so: its interval adjusts the allowance against `target_s` (None: no target)."""
        if self._online_step and self._began_s is not None:
            interval = now_s - self._began_s
            self.last_interval_s = interval
            if target_s:
                if interval > HIGH * target_s:
                    self.allowed //= 2
                elif interval < LOW * target_s:
                    self.allowed = min(self.max_tokens, self.allowed + max(1, self.allowed // 4))
        elif not self._online_step:
            self.last_interval_s = None
        self._began_s = now_s
        self._online_step = False

    def carried(self, online_decodes: int) -> None:
        self._online_step = online_decodes > 0

    def limit(self, online_present: bool, target_s: float | None) -> float:
        """Offline tokens this step may carry (math.inf: no limit)."""
        if not online_present or not target_s:
            return math.inf
        return self.allowed

    def has_room(self, target_s: float | None) -> bool:
        """Whether the online steps leave time for more offline work: no online step
        measured, or the last one under HIGH x the target (a decode's pull condition)."""
        if not target_s or self.last_interval_s is None:
            return True
        return self.last_interval_s < HIGH * target_s
