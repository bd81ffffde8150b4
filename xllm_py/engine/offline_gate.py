"""OfflineGate: how many offline tokens a step may carry beside online streams.

Offline (batch) requests run only in the room online requests leave. Seats, the token
budget and KV are counted by the scheduler itself; this gate adds the time: while online
streams decode here, offline tokens ride their steps only as long as those steps stay
close to what the streams get alone, and within their TPOT target. The gate measures the
interval between consecutive steps that carried online decodes (what an online stream
waits per token), keeps `base_s`, a moving average of that interval over steps that
carried no offline token (the streams alone), and bounds the interval by

    high = min(SLACK_HIGH x base_s, HIGH x target)      low = min(SLACK_LOW x base_s, LOW x target)

adjusting its allowance of offline tokens per step: halved past `high`, additive increase
(a quarter, at least 1) under `low`. Where a step costs about the same at any batch size
(a GPU's memory-bound decode) offline work fills the batch; where it grows with the batch
(a CPU) offline work gets only what costs the streams at most SLACK_HIGH - 1 of their
step. xLLM's PD OOC pulls offline work while the last decode step is under 0.9 x its TPOT
target (`check_able_to_pull`) and caps the offline batch where a step stops getting
cheaper per token (`linear_saturation_bs`).

    no online stream here (for GRACE_S)  -> no limit: offline work runs at full batch
    online streams decoding              -> `allowed` offline tokens a step (0 at first,
                                            until the streams' own steps are measured)
    none for less than GRACE_S           -> `allowed`, at least 1 (a step that had only
                                            online streams must not become an empty one)

Online prompts alone do not limit offline work (a PREFILL engine has no streams): they
go first in every step. The target is the smallest TPOT target of the running online
streams (`tpot_slo_ms`), else the engine's `prompt_tpot_target_ms`; none: the base alone.

Pure Python, no torch. The scheduler calls `begin_step` at each schedule() with the
target in force, asks `limit`, and says with `carried` what the step carried.
"""
from __future__ import annotations

import math

# Interval / target above which the allowance is halved, below which it grows.
HIGH = 0.9
LOW = 0.75
# Interval / base_s (the streams alone) likewise.
SLACK_HIGH = 1.25
SLACK_LOW = 1.1
BASE_ALPHA = 0.1  # weight of a new interval in base_s
# Online streams count as present this long after they were last here (a closed loop of
# online requests leaves gaps of a TTFT between them: a full offline batch there would
# hold up the next stream's first steps).
GRACE_S = 0.5


class OfflineGate:
    def __init__(self, max_tokens: int) -> None:
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        self.max_tokens = max_tokens
        self.allowed = 0  # offline tokens a step beside online streams
        self.base_s: float | None = None  # online step interval without offline tokens
        self.last_interval_s: float | None = None  # between the last two online steps
        self._began_s: float | None = None
        self._online_step = False  # the step under way carries online decodes
        self._offline_tokens = 0  # ... and this many offline tokens
        self._now_s = 0.0
        self._online_seen_s = -math.inf  # online streams last here, and their target then
        self._online_target_s: float | None = None

    def _bounds(self, target_s: float | None) -> tuple[float, float]:
        high = low = math.inf
        if self.base_s is not None:
            high, low = SLACK_HIGH * self.base_s, SLACK_LOW * self.base_s
        if target_s:
            high, low = min(high, HIGH * target_s), min(low, LOW * target_s)
        return high, low

    def begin_step(self, now_s: float, target_s: float | None) -> None:
        """A step begins at `now_s`: the interval since the previous one, if that carried
        online decodes, updates base_s and the allowance (against `target_s`, s or None)."""
        if self._online_step and self._began_s is not None:
            interval = now_s - self._began_s
            self.last_interval_s = interval
            if self._offline_tokens == 0:
                self.base_s = interval if self.base_s is None else (
                    (1 - BASE_ALPHA) * self.base_s + BASE_ALPHA * interval)
            high, low = self._bounds(target_s)
            if interval > high:
                self.allowed //= 2
            elif interval < low:
                self.allowed = min(self.max_tokens, self.allowed + max(1, self.allowed // 4))
        elif not self._online_step:
            self.last_interval_s = None
        self._began_s = self._now_s = now_s
        self._online_step = False
        self._offline_tokens = 0

    def carried(self, online_decodes: int, offline_tokens: int = 0) -> None:
        self._online_step = online_decodes > 0
        self._offline_tokens = offline_tokens

    def limit(self, streams_present: bool, target_s: float | None) -> float:
        """Offline tokens this step may carry (math.inf: no limit)."""
        if streams_present:
            self._online_seen_s, self._online_target_s = self._now_s, target_s
            return self.allowed
        if self._now_s - self._online_seen_s > GRACE_S:
            return math.inf
        return max(1, self.allowed)  # small steps, never none: the engine must not spin

    def has_room(self, target_s: float | None) -> bool:
        """Whether the online streams leave time for more offline work: none measured
        now, or the last interval under the upper bound (a decode's pull condition)."""
        if self.last_interval_s is None:
            return True
        return self.last_interval_s < self._bounds(target_s)[0]
