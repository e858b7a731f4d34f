"""What a worker process holds for its whole life: config, ledger, and the resident lane (engine loaded once).

The worker attaches it to the Celery app (`LaneApp.worker_runtime`) before consuming; tasks reach it through
their base class, `LaneTask.runtime`. It also decides when the worker must stop: its engine died
(`EXIT_ENGINE_LOST`, restarted by systemd), or its engine failed the state checks on too many of the shards it
checked last (`stopped_workers.EXIT_FAILING_CHECKS`, not restarted; see queue/check_streak.py).
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass, field
from functools import cached_property

from dflash_queue.config import Config
from dflash_queue.deadletters import DeadLetters
from dflash_queue.lanes.registry import ResidentLane
from dflash_queue.queue.check_streak import FailedCheckStreak
from dflash_queue.runstate.audits import AuditRecords
from dflash_queue.runstate.ledger import Ledger
from dflash_queue.runstate.stopped_workers import EXIT_FAILING_CHECKS, StoppedWorker, StoppedWorkers
from dflash_queue.runstate.window import ShardWindow
from dflash_queue.storage import Storage

EXIT_ENGINE_LOST = 70  # EX_SOFTWARE: the process manager should restart the worker


@dataclass
class WorkerRuntime:
    # The whole Config: the worker's composition root, whose task steps each take the sections they read.
    config: Config
    fingerprint: str
    ledger: Ledger
    lanes: dict[str, ResidentLane]
    # Where failed tasks, poison samples and unrunnable messages are recorded.
    dead_letters: DeadLetters
    # The worker's storage, shared by its lanes; closed after them.
    storage: Storage | None = None
    # Set when the worker must stop because it cannot serve more tasks (its engine died, or fails its checks),
    # with the status it exits with.
    stop_reason: str | None = None
    exit_code: int = 0
    # The worker's node name (Celery's hostname), under which a stop is recorded.
    node: str = ""
    # The worker process's incarnation id (queue/liveness.py): who stored a shard, for the reference audit.
    incarnation: str = ""
    check_streak: FailedCheckStreak = field(init=False)

    def __post_init__(self) -> None:
        extract = self.config.extract
        self.check_streak = FailedCheckStreak(extract.stop_after_failed_checks, extract.failed_checks_window)

    @cached_property
    def consumption(self) -> ShardWindow:
        """The live dataset's state (later epochs, the window), on the ledger's connection."""
        return ShardWindow(self.ledger.client, self.config.run.name)

    def lane(self, name: str) -> ResidentLane:
        try:
            return self.lanes[name]
        except KeyError:
            raise RuntimeError(f"this worker does not serve the {name!r} lane (serves {sorted(self.lanes)})") from None

    @cached_property
    def stopped_workers(self) -> StoppedWorkers:
        return StoppedWorkers(self.ledger.client, self.config.run.name)

    def request_stop(self, reason: str, exit_code: int = EXIT_ENGINE_LOST) -> None:
        """Warm-stop this worker process (as SIGTERM does) and make it exit with `exit_code`."""
        if self.stop_reason is None:
            self.stop_reason = reason
            self.exit_code = exit_code
            logging.getLogger(__name__).critical("stopping this worker: %s", reason)
            os.kill(os.getpid(), signal.SIGTERM)

    def stop_for_failed_checks(self, lane: str) -> None:
        """The lane's engine failed its checks on too many of its last checked shards: record why in the broker (for
        `status`) and stop, with a status the process manager does not restart on."""
        engine = _engine_name(self.lanes.get(lane), lane)
        reason = self.check_streak.describe(engine, lane)
        stopped = StoppedWorker(self.node, lane, engine, reason, self.check_streak.failures)
        try:
            self.stopped_workers.record(stopped)
        except Exception:  # the stop must happen even when the broker is unreachable
            logging.getLogger(__name__).exception("could not record why this worker stops")
        self.request_stop(reason, EXIT_FAILING_CHECKS)

    @cached_property
    def audits(self) -> AuditRecords:
        """The reference audit's records (runstate/audits.py), on the ledger's connection."""
        return AuditRecords(self.ledger.client, self.config.run.name)

    def stop_for_failed_audit(self, lane: str, reason: str) -> None:
        """A reference audit found a shard this worker process stored to differ from the checkpoint's own forward:
        record why (for `status`) and stop, with a status the process manager does not restart on."""
        engine = _engine_name(self.lanes.get(lane), lane)
        stopped = StoppedWorker(self.node, lane, engine, f"halted by the reference audit: {reason}")
        try:
            self.stopped_workers.record(stopped)
        except Exception:  # the stop must happen even when the broker is unreachable
            logging.getLogger(__name__).exception("could not record why this worker stops")
        self.request_stop(stopped.reason, EXIT_FAILING_CHECKS)

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


def _engine_name(lane: ResidentLane | None, fallback: str) -> str:
    """"transformers" or "vllm": the name of the engine a lane holds (its extractor's or its generate engine's)."""
    engine = getattr(lane, "extractor", None) or getattr(lane, "engine", None)
    return str(getattr(engine, "name", "") or fallback)
