"""What a worker process holds for its whole life: config, ledger, and the resident lane (engine loaded once).

The worker attaches it to the Celery app (`LaneApp.worker_runtime`) before consuming; tasks reach it through
their base class, `LaneTask.runtime`.
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass
from functools import cached_property

from dflash_queue.config import Config
from dflash_queue.consumption import Consumption
from dflash_queue.deadletters import DeadLetters
from dflash_queue.lanes.registry import ResidentLane
from dflash_queue.ledger import Ledger
from dflash_queue.storage import Storage


@dataclass
class WorkerRuntime:
    config: Config
    fingerprint: str
    ledger: Ledger
    lanes: dict[str, ResidentLane]
    # Where failed tasks, poison samples and unrunnable messages are recorded.
    dead_letters: DeadLetters
    # The worker's storage, shared by its lanes; closed after them.
    storage: Storage | None = None
    # Set when the worker must stop because it cannot serve more tasks (its engine died).
    stop_reason: str | None = None

    @cached_property
    def consumption(self) -> Consumption:
        """The live dataset's state (later epochs, the window), on the ledger's connection."""
        return Consumption(self.ledger.client, self.config.run.name)

    def lane(self, name: str) -> ResidentLane:
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

