"""Transient failures become delayed retries with exponential backoff; anything else fails the task.

Transient: the broker or a connection blinked, a local file system was full or failing (broker.transient_retries).
Storage outages have their own, longer, budget (storage.unavailable_task_retries). Each retry is counted in the
ledger (`storage_retries`, `transient_retries`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import redis
from celery import Task
from celery.utils.log import get_task_logger
from celery.utils.time import get_exponential_backoff_interval

from dflash_queue.errors import StorageUnavailable, TransientIOError
from dflash_queue.queue.config import BrokerConfig
from dflash_queue.runstate.ledger import Ledger
from dflash_queue.storage.config import StorageConfig

log = get_task_logger(__name__)

TRANSIENT_ERRORS = (redis.ConnectionError, redis.TimeoutError, ConnectionError, TimeoutError, TransientIOError)


def backoff_s(attempt: int, cap_s: float) -> int:
    """Celery's exponential backoff with full jitter (what `retry_backoff` and `retry_jitter` give autoretried
    tasks): a random delay up to 2 s, 4 s, 8 s ... capped at cap_s, and at least 1 s. The retries here are
    explicit, since storage outages and broken connections have budgets of their own."""
    return max(1, get_exponential_backoff_interval(factor=2, retries=attempt, maximum=int(cap_s), full_jitter=True))


@contextmanager
def transient_retries(task: Task, broker: BrokerConfig, storage: StorageConfig, shard_id: str) -> Iterator[None]:
    """Storage outages and broken connections become delayed retries of `task` (Celery's Retry is raised)."""
    try:
        yield
    except StorageUnavailable as exc:
        delay = backoff_s(task.request.retries, broker.retry_backoff_max_s)
        log.warning("shard %s: storage unavailable (retry %d in %.1f s): %s", shard_id, task.request.retries + 1, delay, exc)
        raise task.retry(exc=exc, countdown=delay, max_retries=storage.unavailable_task_retries) from exc
    except TRANSIENT_ERRORS as exc:
        delay = backoff_s(task.request.retries, broker.retry_backoff_max_s)
        log.warning("shard %s: %s (retry %d in %.1f s): %s", shard_id, type(exc).__name__, task.request.retries + 1, delay, exc)
        raise task.retry(exc=exc, countdown=delay, max_retries=broker.transient_retries) from exc


def count_retry(ledger: Ledger, exc: BaseException) -> None:
    """One retry in the ledger, by kind; never raises (the retry happens anyway)."""
    name = "storage_retries" if isinstance(exc, StorageUnavailable) else "transient_retries"
    try:
        ledger.add({name: 1})
    except Exception:
        log.exception("could not count a retry")
