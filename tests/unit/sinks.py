"""Output sinks for engine tests."""
from __future__ import annotations

import threading


class DoneSink:
    """Records a request's outputs and when it has finished (its last output)."""

    def __init__(self) -> None:
        self.outputs: list = []
        self.done = threading.Event()

    def emit(self, output) -> None:
        self.outputs.append(output)
        if output.finished:
            self.done.set()
