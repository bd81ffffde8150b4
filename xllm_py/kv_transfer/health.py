"""TransferHealth: whether a worker's KV transfers still work, for the engine's /health.

A transport can end up poisoned while everything else looks fine (a wedged UCX worker,
a dead loop thread): every transfer fails and the health check stays green, so nothing
restarts the process. Broken for good here means: the backend's loop thread is gone, or
BROKEN_MIN_FAILURES transfers failed in a row, with no success in between, the first of
them BROKEN_AFTER_S ago or more. One bad peer among good ones, or a cut that heals within
the window, is not (any success resets the streak). Pure Python; the clock is injected.
"""
from __future__ import annotations

import time
from typing import Callable

BROKEN_MIN_FAILURES = 5
BROKEN_AFTER_S = 30.0


class TransferHealth:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._streak = 0
        self._since: float | None = None
        self._last = ""

    def succeeded(self) -> None:
        self._streak, self._since, self._last = 0, None, ""

    def failed(self, why: str) -> None:
        self._streak += 1
        self._since = self._since if self._since is not None else self._clock()
        self._last = why

    def broken(self, loop_alive: bool = True) -> str | None:
        """None while transfers work; else why (one line, for /health's body)."""
        if not loop_alive:
            return "KV transfer broken: its loop thread has stopped"
        if self._since is None or self._streak < BROKEN_MIN_FAILURES:
            return None
        span = self._clock() - self._since
        if span < BROKEN_AFTER_S:
            return None
        return (f"KV transfer broken: {self._streak} transfers failed in a row over "
                f"{span:.0f}s, none succeeded (last: {self._last})")
