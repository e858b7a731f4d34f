"""Dead letters of a lane task: the task that failed for good (a permanent error, retries exhausted, delivered too
often), and the poison samples a lane left out of a shard it stored.

A failed shard's state is set to failed (in the ledger, or its epoch's states) and its place in the window is
given back: a shard that will not be stored holds none.
"""

from __future__ import annotations

from typing import Any

from celery.utils.log import get_task_logger

from dflash_queue.deadletters import DeadLetters
from dflash_queue.deadletters.recording import dead_letter_samples, dead_letter_task
from dflash_queue.queue.steps.lane_message import LaneMessage
from dflash_queue.runstate.ledger import Ledger
from dflash_queue.runstate.shard_states import FAILED
from dflash_queue.runstate.window import ShardWindow

log = get_task_logger(__name__)


class DeadLettering:
    def __init__(self, dead_letters: DeadLetters, ledger: Ledger, consumption: ShardWindow) -> None:
        self.dead_letters = dead_letters
        self.ledger = ledger
        self.consumption = consumption

    def task_failed(
        self, task_name: str, args: Any, kwargs: Any, exc: BaseException, *, deliveries: int, worker: str
    ) -> None:
        """The task's dead letter, its shard failed and its window place given back. Never raises for the
        bookkeeping: the original error must stay visible."""
        epoch = int((kwargs or {}).get("epoch", 0))
        record = dead_letter_task(
            self.dead_letters, task_name, args, kwargs, exc, deliveries=deliveries, worker=worker
        )
        if record.shard_id:
            error = f"{task_name}: {type(exc).__name__}: {exc}"
            try:
                if epoch:
                    self.consumption.set_epoch_state(epoch, record.shard_id, FAILED, error)
                else:
                    self.ledger.mark_failed(record.shard_id, error)
                # A shard that will not be stored gives its place in the window back.
                self.consumption.give_back_place(epoch, record.shard_id)
            except Exception:  # never let bookkeeping hide the original error
                log.exception("could not record the failure of shard %s", record.shard_id)

    def samples_poisoned(
        self,
        task_name: str,
        message: LaneMessage,
        poisoned: tuple[tuple[str, BaseException], ...],
        *,
        deliveries: int,
        worker: str,
    ) -> None:
        """One dead letter per sample the lane left out of the shard (none: nothing recorded)."""
        if poisoned:
            dead_letter_samples(
                self.dead_letters,
                task_name,
                message.args,
                message.kwargs,
                poisoned,
                deliveries=deliveries,
                worker=worker,
            )
