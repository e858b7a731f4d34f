"""When shards failing their state checks stop a worker (queue/check_streak.py: so many among the last checked), and the stop's record in the broker
(runstate/stopped_workers.py). The worker itself, stopping and exiting, is tested with real processes in
tests/faults/test_worker_stops.py."""

from __future__ import annotations

import threading

import redis

from dflash_queue.engines.state_checks import CanaryMismatch, ImplausibleHiddenStates
from dflash_queue.errors import EngineStatesInvalid
from dflash_queue.queue.check_streak import MESSAGE_CHARS, STATE_CHECK_FAILURES, FailedCheckStreak
from dflash_queue.runstate.stopped_workers import EXIT_FAILING_CHECKS, StoppedWorker, StoppedWorkers


def test_with_a_window_of_the_limit_only_failures_in_a_row_trip_it():
    streak = FailedCheckStreak(3)  # the window defaults to the limit
    assert streak.window == 3
    assert not streak.failed("a", CanaryMismatch("canary sample x: layer 1 differs"))
    assert not streak.failed("b", ImplausibleHiddenStates("1 implausible hidden states"))
    streak.passed()
    assert not streak.failed("c", CanaryMismatch("one"))
    assert not streak.failed("d", EngineStatesInvalid("two"))
    assert streak.failed("e", CanaryMismatch("three"))
    assert streak.failures == [("c", "CanaryMismatch: one"), ("d", "EngineStatesInvalid: two"),
                               ("e", "CanaryMismatch: three")]
    # Tripped for good: later failures are handed back too, a pass no longer resets it.
    streak.passed()
    assert streak.failed("f", CanaryMismatch("four")) and len(streak.failures) == 3
    reason = streak.describe("vllm", "extract")
    assert reason.startswith("the vllm extract engine failed its state checks on 3 shards in a row "
                             "(extract.stop_after_failed_checks = 3): shard c: CanaryMismatch: one; shard d: ")
    assert "shard e handed back; the 2 before it are dead letters" in reason


def test_failures_among_the_last_checked_shards_trip_it_though_passing_shards_lie_between_them():
    """3 of the last 6: a fault that fails every other shard (only the long samples, one batch shape) stops the
    worker, where failures in a row would never have counted more than one."""
    streak = FailedCheckStreak(3, window=6)
    outcomes = []
    for number in range(5):
        if number % 2:
            streak.passed()
        else:
            outcomes.append(streak.failed(f"s{number}", CanaryMismatch(f"fault {number}")))
    assert outcomes == [False, False, True]
    assert [shard for shard, _ in streak.failures] == ["s0", "s2", "s4"] and streak.checked == 5
    reason = streak.describe("vllm", "extract")
    assert reason.startswith("the vllm extract engine failed its state checks on 3 of the 5 shards it checked "
                             "(extract.stop_after_failed_checks = 3 within extract.failed_checks_window = 6): shard "
                             "s0: CanaryMismatch: fault 0; shard s2: ")
    assert "shard s4 handed back; the 2 before it are dead letters" in reason
    # The same pattern under failures in a row (the window equal to the count) never stops.
    in_a_row = FailedCheckStreak(3, window=3)
    for number in range(20):
        assert number % 2 or not in_a_row.failed(f"s{number}", CanaryMismatch("fault"))
        if number % 2:
            in_a_row.passed()


def test_failures_older_than_the_window_no_longer_count():
    streak = FailedCheckStreak(2, window=4)
    assert not streak.failed("old", CanaryMismatch("one"))
    for _ in range(4):
        streak.passed()
    assert streak.failures == [] and streak.checked == 4
    assert not streak.failed("a", CanaryMismatch("two"))
    streak.passed()
    streak.passed()
    assert streak.failed("b", ImplausibleHiddenStates("three"))
    reason = streak.describe("transformers", "extract")
    assert "on 2 of the last 4 shards it checked (extract.stop_after_failed_checks = 2 within " in reason
    assert [shard for shard, _ in streak.failures] == ["a", "b"]


def test_a_limit_of_zero_never_trips_and_long_messages_are_cut():
    streak = FailedCheckStreak(0)
    for number in range(20):
        assert not streak.failed(f"s{number}", CanaryMismatch("x" * 1000))
    assert all(len(message) == MESSAGE_CHARS and message.endswith("...") for _, message in streak.failures)


def test_only_the_state_checks_count():
    assert set(STATE_CHECK_FAILURES) == {CanaryMismatch, ImplausibleHiddenStates, EngineStatesInvalid}


def test_failures_from_concurrent_tasks_trip_it_once_at_the_limit():
    streak = FailedCheckStreak(5)
    tripped: list[bool] = []
    lock = threading.Lock()

    def fail(number: int) -> None:
        result = streak.failed(f"s{number}", CanaryMismatch(str(number)))
        with lock:
            tripped.append(result)

    threads = [threading.Thread(target=fail, args=(n,)) for n in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert tripped.count(False) == 4 and len(streak.failures) == 5


def test_stop_records_are_kept_per_node_and_cleared_when_the_node_starts_again(redis_url):
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    records = StoppedWorkers(client, "stops-run")
    client.delete(records.key)
    assert records.all() == [] and records.clear("extract-0@node") is None
    first = StoppedWorker("extract-0@node", "extract", "transformers", "the transformers extract engine failed ...",
                          [("s1", "CanaryMismatch: one"), ("s2", "CanaryMismatch: two")], time=100.0)
    records.record(first)
    records.record(StoppedWorker("extract-1@other", "extract", "vllm", "the vllm ...", time=200.0))
    assert records.key == "dfq:stops-run:stopped_workers"
    assert [r.node for r in records.all()] == ["extract-0@node", "extract-1@other"]
    assert records.all()[0] == first and first.exit_status == EXIT_FAILING_CHECKS
    assert records.clear("extract-0@node") == first
    assert [r.node for r in records.all()] == ["extract-1@other"]
    client.hset(records.key, "broken@node", "{not json")
    shown = {r.node: r for r in records.all()}
    assert shown["broken@node"].reason.startswith("unreadable stop record")
    client.delete(records.key)
