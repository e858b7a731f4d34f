from __future__ import annotations

import random

import pytest
import redis

from dflash_queue.errors import StorageUnavailable, TransientIOError
from dflash_queue.queue.config import BrokerConfig
from dflash_queue.queue.steps.retries import backoff_s, count_retry, transient_retries
from dflash_queue.runstate.ledger import Ledger
from dflash_queue.storage.config import StorageConfig


def test_retry_delays_grow_exponentially_with_full_jitter_between_one_second_and_the_cap():
    random.seed(0)
    for attempt in range(12):
        bound = min(2 * 2**attempt, 120)
        delays = [backoff_s(attempt, 120.0) for _ in range(400)]
        assert all(1 <= d <= bound for d in delays), (attempt, min(delays), max(delays))
        # Full jitter: the delays spread over the whole range, not only its top half.
        assert max(delays) == bound and min(delays) <= max(1, bound // 4)


class Request:
    retries = 0


class RetriedTask:
    """What the step uses of a Celery task: `retry` returns the exception Celery's would raise."""

    def __init__(self) -> None:
        self.request = Request()
        self.retried: list[tuple[BaseException, int]] = []

    def retry(self, *, exc, countdown, max_retries):
        self.retried.append((exc, max_retries))
        assert 1 <= countdown <= 2
        return Retry()


class Retry(Exception):
    pass


@pytest.mark.parametrize(
    ("error", "budget"),
    [
        (StorageUnavailable("503 from the store"), "storage"),
        (ConnectionError("reset"), "broker"),
        (redis.ConnectionError("broker gone"), "broker"),
        (TransientIOError("ENOSPC"), "broker"),
    ],
)
def test_storage_outages_and_broken_connections_are_retried_each_on_its_own_budget(error, budget):
    task = RetriedTask()
    broker, storage = BrokerConfig(transient_retries=5), StorageConfig(url="/tmp/x", unavailable_task_retries=30)
    with pytest.raises(Retry), transient_retries(task, broker, storage, "s1"):
        raise error
    assert task.retried == [(error, 30 if budget == "storage" else 5)]


def test_other_errors_fail_the_task():
    task = RetriedTask()
    broker, storage = BrokerConfig(), StorageConfig(url="/tmp/x")
    with pytest.raises(ValueError), transient_retries(task, broker, storage, "s1"):
        raise ValueError("bad input")
    assert task.retried == []


def test_each_retry_is_counted_by_its_kind(redis_url):
    ledger = Ledger.from_url(redis_url, "r")
    count_retry(ledger, StorageUnavailable("503"))
    count_retry(ledger, ConnectionError("reset"))
    count_retry(ledger, TimeoutError("slow"))
    assert ledger.counters() == {"storage_retries": 1, "transient_retries": 2}
    count_retry(BrokerGone(), ConnectionError("reset"))  # never raises


class BrokerGone:
    def add(self, counts, *, now=None) -> None:
        raise redis.ConnectionError("the broker is gone")
