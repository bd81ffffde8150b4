"""The OpenMP settings of an engine process, set before torch loads libgomp (it reads its
environment once, when loaded).

GOMP_SPINCOUNT: how long a libgomp worker spins for the next parallel region before it
sleeps. libgomp's default (300,000 spins, ~3 ms) with an engine's team on cores of its
own, or a near-zero one once the process has more threads than cores. A decode step is
~90 short regions a few microseconds apart (the Gemma 3 decode runner), so a worker
that sleeps pays a wake-up per region (gemma-3-270m at batch 1, measured before the
engine thread loaded the model: 14.1 ms a step against 9.3 ms); one that spins 3 ms
after every step burns a core between steps, which a machine whose cores are shared
(several engines, a service, a client) pays for: the other processes' event loops run
late. 10,000 spins (~0.1 ms) cover the gaps within a step and stop soon after it
(figures: docs/benchmarks.md, the GOMP_SPINCOUNT row). A value in the environment wins.
"""
from __future__ import annotations

from xllm_py.config import apply_env_defaults

OMP_ENV_DEFAULTS = {"GOMP_SPINCOUNT": "10000"}


def set_omp_env() -> None:
    """Call before torch is imported."""
    apply_env_defaults(OMP_ENV_DEFAULTS)
