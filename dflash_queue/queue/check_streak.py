"""Shards in a row whose states failed the engine's checks: past `extract.stop_after_failed_checks` the engine is
at fault, not the shards, and the worker stops (see dflash_queue/runstate/stopped_workers.py).

A failure of the canary (CanaryMismatch), of the plausibility checks (ImplausibleHiddenStates) or of what the
engine handed over (EngineStatesInvalid) fails its shard for good: a dead letter. One such shard says little about
the engine; several in a row, with no shard passing between them, say it computes wrong states. The shard whose
failure completes the streak is handed back to the queue, not dead-lettered (its failure is put down to the
engine), and so is any shard failing after it while the worker stops; the shards before it are dead letters,
listed in the worker's stop record for requeueing once the engine is fixed. A shard whose checks pass ends the
streak; shards that fail otherwise (storage, a poison sample) or are skipped (already stored) neither count nor end
it.
"""

from __future__ import annotations

import threading

from dflash_queue.engines.state_checks import CanaryMismatch, ImplausibleHiddenStates
from dflash_queue.errors import EngineStatesInvalid

STATE_CHECK_FAILURES: tuple[type[BaseException], ...] = (CanaryMismatch, ImplausibleHiddenStates, EngineStatesInvalid)
# Each failure's message as kept in the stop record and its log line.
MESSAGE_CHARS = 240


class FailedCheckStreak:
    """Thread-safe: the tasks of one worker process run in several threads. `limit` 0 never trips."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._failures: list[tuple[str, str]] = []
        self._tripped = False
        self._lock = threading.Lock()

    def failed(self, shard_id: str, exc: BaseException) -> bool:
        """Count a shard whose checks failed; True when the streak is (now or already) long enough to stop."""
        message = f"{type(exc).__name__}: {exc}"
        if len(message) > MESSAGE_CHARS:
            message = message[: MESSAGE_CHARS - 3] + "..."
        with self._lock:
            if not self._tripped:
                self._failures.append((shard_id, message))
                self._tripped = 0 < self.limit <= len(self._failures)
            return self._tripped

    def passed(self) -> None:
        """A shard's checks passed: the streak starts over (unless it already stopped the worker)."""
        with self._lock:
            if not self._tripped:
                self._failures.clear()

    @property
    def failures(self) -> list[tuple[str, str]]:
        """(shard id, "ExceptionType: message") of the streak, oldest first."""
        with self._lock:
            return list(self._failures)

    def describe(self, engine: str, lane: str) -> str:
        failures = self.failures
        listed = "; ".join(f"shard {shard}: {message}" for shard, message in failures)
        return (
            f"the {engine} {lane} engine failed its state checks on {len(failures)} shards in a row "
            f"(extract.stop_after_failed_checks = {self.limit}): {listed}. This worker takes no more tasks: the "
            f"remaining shards stay queued for a healthy worker (shard {failures[-1][0]} handed back; the "
            f"{len(failures) - 1} before it are dead letters, to requeue once the engine or the node is fixed)"
        )
