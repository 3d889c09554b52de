"""SIGTERM (what Slurm and torchrun send) and SIGINT, turned into a request to stop at the next round boundary."""

from __future__ import annotations

import signal
import threading
import time
from typing import Any


class StopRequest:
    """SIGTERM (what Slurm and torchrun send) and SIGINT turned into a request to stop at the next round boundary,
    where the runtime checkpoints and records the run as interrupted. A second SIGINT stops at once."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signal: str | None = None
        self.since = 0.0
        """time.monotonic() of the first signal."""
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: object) -> None:
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal, self.since = signal.Signals(signum).name, time.monotonic()
