"""Tasks handed back to the queue unrun, for a healthy worker, when the fault is not the shard's.

A dead engine: the message goes back and this worker stops instead of failing every task it would take next. An
engine that fails its state checks on `extract.stop_after_failed_checks` of the last `extract.failed_checks_window`
shards it checked: the shard that completes the count goes back as well, and the worker stops for good
(queue/check_streak.py); a failure short of the count passes through, to a dead letter. A worker shutting down: the task goes back. Each such delivery is uncounted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from celery.exceptions import Reject
from celery.utils.log import get_task_logger

from dflash_queue.errors import EngineUnavailable, WorkerShuttingDown
from dflash_queue.queue.check_streak import STATE_CHECK_FAILURES
from dflash_queue.queue.runtime import WorkerRuntime

log = get_task_logger(__name__)


@contextmanager
def handing_back(rt: WorkerRuntime, lane: str, shard_id: str, uncount: Callable[[], None]) -> Iterator[None]:
    try:
        yield
    except EngineUnavailable as exc:
        uncount()
        rt.request_stop(f"{type(exc).__name__}: {exc}")
        raise Reject(str(exc), requeue=True) from exc
    except STATE_CHECK_FAILURES as exc:
        if not rt.check_streak.failed(shard_id, exc):
            raise  # a dead letter (on_failure)
        uncount()
        rt.stop_for_failed_checks(lane)
        log.error("shard %s handed back: %s: %s", shard_id, type(exc).__name__, exc)
        raise Reject(str(exc), requeue=True) from exc
    except WorkerShuttingDown as exc:
        uncount()
        log.info("%s: requeued", exc)
        raise Reject(str(exc), requeue=True) from None
