"""What a worker process holds for its whole life: config, ledger, and the resident lane (engine loaded once)."""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass
from typing import Any

from dflash_queue.config import Config
from dflash_queue.ledger import Ledger


@dataclass
class WorkerRuntime:
    config: Config
    fingerprint: str
    ledger: Ledger
    lanes: dict[str, Any]
    # Set when the worker must stop because it cannot serve more tasks (its engine died).
    stop_reason: str | None = None
    # The worker's storage, shared by its lanes; closed after them.
    storage: Any = None
    # Where failed tasks, poison samples and unrunnable messages are recorded (dflash_queue.deadletters).
    dead_letters: Any = None

    def lane(self, name: str) -> Any:
        try:
            return self.lanes[name]
        except KeyError:
            raise RuntimeError(f"this worker does not serve the {name!r} lane (serves {sorted(self.lanes)})") from None

    def request_stop(self, reason: str) -> None:
        """Warm-stop this worker process (as SIGTERM does) and make it exit with a failure code."""
        if self.stop_reason is None:
            self.stop_reason = reason
            logging.getLogger(__name__).critical("stopping this worker: %s", reason)
            os.kill(os.getpid(), signal.SIGTERM)

    def begin_shutdown(self) -> None:
        """Warm shutdown began: lanes stop taking up new work (running work finishes)."""
        for lane in self.lanes.values():
            begin = getattr(lane, "begin_shutdown", None)
            if begin is not None:
                begin()

    def close(self) -> None:
        for lane in self.lanes.values():
            lane.close()
        self.lanes.clear()
        close_storage = getattr(self.storage, "close", None)
        if close_storage is not None:
            close_storage()


_current: WorkerRuntime | None = None


def install(runtime: WorkerRuntime) -> None:
    global _current
    _current = runtime


def current() -> WorkerRuntime:
    if _current is None:
        raise RuntimeError("no worker runtime installed in this process; start workers with `dflash-queue worker`")
    return _current


def uninstall() -> WorkerRuntime | None:
    global _current
    runtime, _current = _current, None
    return runtime
