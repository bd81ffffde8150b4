"""Step observers: what the engine tells the parts that watch its steps, after each step
it runs (LLMEngine.step), in the order of `LLMEngine.step_observers`.

One record per step that computed something: what it carried (the scheduler's output),
when its forward began and what its forward, sampling and scheduler update took (the
step trace's and the heartbeat's measure), and what the whole step took from scheduling
to outputs on the engine's step clock (the measure of the latency profile, which was
fitted on that clock: self_profile.py). Observers: `StepStats` (the engine's own counts),
`StepTrace` (step_trace.py, the setting step_trace), `ProfileCorrector` (self_profile.py, a
PREFILL or DECODE that measured its profile). None of them may change the step.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from xllm_py.engine.scheduler_types import SchedulerOutput
    from xllm_py.engine.tpot_guard import TpotGuard


@dataclasses.dataclass(frozen=True)
class StepRecord:
    out: SchedulerOutput  # what the step computed
    start_s: float  # time.monotonic() when its forward began (scheduling done)
    ms: float  # its forward, sampling and scheduler update (what the TPOT guard measures)
    whole_ms: float  # scheduling to outputs, on the engine's step clock
    num_waiting: int  # requests waiting once it computed
    guard: TpotGuard | None  # the scheduler's TPOT guard (its answer this step)


class StepObserver(Protocol):
    def on_step(self, step: StepRecord) -> None: ...


class StepStats:
    """Steps run, and the recent longest step (a max that decays by 2% a step): what the
    heartbeat reports as recent_max_tbt_ms."""

    def __init__(self) -> None:
        self.num_steps = 0
        self.recent_max_ms = 0.0

    def on_step(self, step: StepRecord) -> None:
        self.num_steps += 1
        self.recent_max_ms = max(self.recent_max_ms * 0.98, step.ms)
