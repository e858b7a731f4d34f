"""Deliveries handed back to the queue unrun: a dead engine, the shard that completes the count of failed checks
among the last checked shards, shutdown; a failed check short of the count goes on to a dead letter."""

from __future__ import annotations

import pytest
from celery.exceptions import Reject

from dflash_queue.engines.state_checks import CanaryMismatch
from dflash_queue.errors import EngineUnavailable, WorkerShuttingDown
from dflash_queue.queue.check_streak import FailedCheckStreak
from dflash_queue.queue.steps.hand_back import handing_back


class Runtime:
    """What the step uses of WorkerRuntime, without signalling this process."""

    def __init__(self, stop_after_failed_checks: int = 2, window: int | None = None) -> None:
        self.check_streak = FailedCheckStreak(stop_after_failed_checks, window)
        self.stops: list[str] = []

    def request_stop(self, reason: str) -> None:
        self.stops.append(reason)

    def stop_for_failed_checks(self, lane: str) -> None:
        self.stops.append(f"failed checks on {lane}")


def handed(rt: Runtime, exc: BaseException, shard_id: str = "s1") -> tuple[BaseException, list[str]]:
    uncounted: list[str] = []
    uncount = lambda: uncounted.append(shard_id)  # noqa: E731
    with pytest.raises(BaseException) as raised, handing_back(rt, "extract", shard_id, uncount):
        raise exc
    return raised.value, uncounted


def test_a_dead_engine_requeues_the_task_and_stops_the_worker():
    rt = Runtime()
    raised, uncounted = handed(rt, EngineUnavailable("engine died"))
    assert isinstance(raised, Reject) and raised.requeue and uncounted == ["s1"]
    assert rt.stops == ["EngineUnavailable: engine died"]


def test_shutdown_requeues_the_task_and_leaves_the_worker_to_stop():
    rt = Runtime()
    raised, uncounted = handed(rt, WorkerShuttingDown("shard s1: shutting down"))
    assert isinstance(raised, Reject) and raised.requeue and uncounted == ["s1"] and rt.stops == []


def test_a_failed_check_is_a_dead_letter_until_the_streak_hands_its_shard_back():
    rt = Runtime(stop_after_failed_checks=2)
    first = CanaryMismatch("sample x differs")
    raised, uncounted = handed(rt, first, "s1")
    assert raised is first and uncounted == [] and rt.stops == []
    raised, uncounted = handed(rt, CanaryMismatch("sample y differs"), "s2")
    assert isinstance(raised, Reject) and raised.requeue and uncounted == ["s2"]
    assert rt.stops == ["failed checks on extract"]


def test_the_failure_completing_the_count_among_the_last_checked_shards_is_handed_back():
    """2 of the last 3: passing shards between the failures do not save the engine."""
    rt = Runtime(stop_after_failed_checks=2, window=3)
    first = CanaryMismatch("sample x differs")
    assert handed(rt, first, "s1") == (first, []) and rt.stops == []
    rt.check_streak.passed()
    raised, uncounted = handed(rt, CanaryMismatch("sample y differs"), "s3")
    assert isinstance(raised, Reject) and raised.requeue and uncounted == ["s3"]
    assert rt.stops == ["failed checks on extract"]


def test_other_errors_pass_through_counted():
    rt = Runtime()
    error = ValueError("a bad shard")
    raised, uncounted = handed(rt, error)
    assert raised is error and uncounted == [] and rt.stops == []
