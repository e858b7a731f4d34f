"""Shards whose states failed the engine's checks, counted over the last shards a worker checked: past
`extract.stop_after_failed_checks` failures among the last `extract.failed_checks_window` the engine is at fault,
not the shards, and the worker stops (see dflash_queue/runstate/stopped_workers.py).

A failure of the canary (CanaryMismatch), of the plausibility checks (ImplausibleHiddenStates) or of what the
engine handed over (EngineStatesInvalid) fails its shard for good: a dead letter. One such shard says little about
the engine; several among its last checked shards say it computes wrong states, even when shards that pass lie
between them (a fault that hits only the long samples, or one batch shape, fails some shards and not others). The
shard whose failure completes the count is handed back to the queue, not dead-lettered (its failure is put down to
the engine), and so is any shard failing after it while the worker stops; the failed shards before it are dead
letters, listed in the worker's stop record for requeueing once the engine is fixed. A shard whose checks pass
counts as checked, pushing older failures out of the window; shards that fail otherwise (storage, a poison sample)
or are skipped (already stored) neither count nor pass.
"""

from __future__ import annotations

import threading
from collections import deque

from dflash_queue.engines.state_checks import CanaryMismatch, ImplausibleHiddenStates
from dflash_queue.errors import EngineStatesInvalid

STATE_CHECK_FAILURES: tuple[type[BaseException], ...] = (CanaryMismatch, ImplausibleHiddenStates, EngineStatesInvalid)
# Each failure's message as kept in the stop record and its log line.
MESSAGE_CHARS = 240


class FailedCheckStreak:
    """`limit` failures among the last `window` checked shards (default: `limit`, failures in a row) trip it.
    Thread-safe: the tasks of one worker process run in several threads, counted in the order they finish. `limit`
    0 never trips."""

    def __init__(self, limit: int, window: int | None = None) -> None:
        self.limit = limit
        self.window = max(window or limit, limit, 1)
        # The last `window` checked shards, oldest first: (shard id, "ExceptionType: message"), or None for a pass.
        self._checked: deque[tuple[str, str] | None] = deque(maxlen=self.window)
        self._tripped = False
        self._lock = threading.Lock()

    def failed(self, shard_id: str, exc: BaseException) -> bool:
        """Count a shard whose checks failed; True when the failures in the window are (now or already) enough to
        stop."""
        message = f"{type(exc).__name__}: {exc}"
        if len(message) > MESSAGE_CHARS:
            message = message[: MESSAGE_CHARS - 3] + "..."
        with self._lock:
            if not self._tripped:
                self._checked.append((shard_id, message))
                self._tripped = 0 < self.limit <= sum(1 for outcome in self._checked if outcome is not None)
            return self._tripped

    def passed(self) -> None:
        """A shard's checks passed: one more checked shard in the window (unless it already stopped the worker)."""
        with self._lock:
            if not self._tripped:
                self._checked.append(None)

    @property
    def failures(self) -> list[tuple[str, str]]:
        """(shard id, "ExceptionType: message") of the failures in the window, oldest first."""
        with self._lock:
            return [outcome for outcome in self._checked if outcome is not None]

    @property
    def checked(self) -> int:
        """Shards in the window (at most `window`): passed and failed."""
        with self._lock:
            return len(self._checked)

    def describe(self, engine: str, lane: str) -> str:
        failures = self.failures
        listed = "; ".join(f"shard {shard}: {message}" for shard, message in failures)
        if self.window == self.limit:
            counted = f"on {len(failures)} shards in a row (extract.stop_after_failed_checks = {self.limit})"
        else:
            checked = self.checked
            among = f"the last {checked}" if checked >= self.window else f"the {checked}"
            counted = (
                f"on {len(failures)} of {among} shards it checked (extract.stop_after_failed_checks = {self.limit} "
                f"within extract.failed_checks_window = {self.window})"
            )
        return (
            f"the {engine} {lane} engine failed its state checks {counted}: {listed}. This worker takes no more tasks: "
            f"the remaining shards stay queued for a healthy worker (shard {failures[-1][0]} handed back; the "
            f"{len(failures) - 1} before it are dead letters, to requeue once the engine or the node is fixed)"
        )
