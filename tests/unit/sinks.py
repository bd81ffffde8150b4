"""Output sinks for engine tests."""
from __future__ import annotations

import threading


class DoneSink:
    """Records when a request has finished (its last output)."""

    def __init__(self) -> None:
        self.done = threading.Event()

    def emit(self, output) -> None:
        if output.finished:
            self.done.set()
