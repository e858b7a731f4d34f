"""How long a worker process was busy, counted once however many of its tasks overlap.

Tasks report the busy time accrued since the previous report as a `{lane}_busy_ms` counter; summed over
workers it is worker-seconds, and generated tokens per worker-second is an engine's measured throughput (what
the planner uses), also when an engine runs several tasks at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


class BusyClock:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._in_flight = 0
        self._mark = 0.0

    def start(self) -> None:
        with self._lock:
            if self._in_flight == 0:
                self._mark = self._clock()
            self._in_flight += 1

    def stop(self) -> float:
        """End one task; returns the busy seconds accrued since the last start from idle or the last stop."""
        with self._lock:
            if self._in_flight == 0:
                raise RuntimeError("BusyClock.stop without a matching start")
            now = self._clock()
            elapsed, self._mark = now - self._mark, now
            self._in_flight -= 1
            return elapsed

    def task(self) -> TaskTiming:
        """`with clock.task() as timing: ...` then `timing.busy_ms`."""
        return TaskTiming(self)


@dataclass
class TaskTiming:
    clock: BusyClock
    busy_ms: int = 0

    def __enter__(self) -> TaskTiming:
        self.clock.start()
        return self

    def __exit__(self, *exc) -> None:
        self.busy_ms = round(self.clock.stop() * 1000)


