"""Each delivery of a task counted in Redis before the work starts, and the limit on them (broker.max_deliveries).

A worker killed by the kernel (OOM, segfault, SIGKILL) runs no failure handler: the message simply comes back.
Counted before the work, those deliveries are seen too, and a task delivered more than `broker.max_deliveries`
times is dead-lettered unrun instead of taking down one more worker. A delivery handed back unrun (shutdown, a dead
engine, a full window) is not the task's fault: it is uncounted.
"""

from __future__ import annotations

from celery.utils.log import get_task_logger

from dflash_queue.errors import DflashQueueError
from dflash_queue.queue.config import BrokerConfig
from dflash_queue.runstate.ledger import Ledger

log = get_task_logger(__name__)


class DeliveryLimitExceeded(DflashQueueError):
    """The task was delivered more often than broker.max_deliveries allows."""


class DeliveryCount:
    """The deliveries of one message: a task id and its retries (a retry is a new message, counted afresh)."""

    def __init__(self, ledger: Ledger, broker: BrokerConfig, task_id: str, retries: int) -> None:
        self.ledger = ledger
        self.max_deliveries = broker.max_deliveries
        self.task_id = task_id
        self.retries = retries

    def count(self) -> int:
        """Count this delivery; returns how many there were, this one included."""
        return self.ledger.count_delivery(self.task_id, self.retries)

    def limit_exceeded(self, deliveries: int) -> DeliveryLimitExceeded | None:
        """The error to dead-letter the task with, unrun, when it was delivered too often; None: run it."""
        if deliveries <= self.max_deliveries:
            return None
        return DeliveryLimitExceeded(
            f"delivered {deliveries} times (broker.max_deliveries = {self.max_deliveries}); the "
            "workers that ran it died each time (out of memory, a crash, a kill): see their logs"
        )

    def uncount(self) -> None:
        """A delivery handed back unrun is not the task's fault: uncount it."""
        try:
            self.ledger.count_delivery(self.task_id, self.retries, by=-1)
        except Exception:
            log.exception("could not uncount a requeued delivery")
