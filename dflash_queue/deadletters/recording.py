"""Writing dead letters from a worker: failed tasks, poison samples, and messages that cannot be run.

Malformed messages (bad JSON, content that is not JSON, an unknown task name, a message without task headers)
never reach a task: Celery's consumer logs and drops them. `WorkerConsumer` records each one first, so
the operator sees it in `dflash-queue dead list` and the workers carry on.
"""

from __future__ import annotations

import logging
from typing import Any

from celery.worker.consumer import Consumer

from dflash_queue.deadletters.records import (
    MESSAGE,
    SAMPLE,
    TASK,
    UNKNOWN_LANE,
    DeadLetter,
    DeadLetters,
    ExceptionFields,
    exception_fields,
    record_id,
)
from dflash_queue.lanes.registry import lane_of_task

log = logging.getLogger(__name__)

# Bytes of an undecodable body kept in its dead letter.
BODY_CHARS = 2000


def _lane_name(task_name: str) -> str:
    spec = lane_of_task(task_name)
    return spec.name if spec is not None else UNKNOWN_LANE


def _store(dead_letters: DeadLetters, record: DeadLetter) -> None:
    try:
        dead_letters.add(record)
        log.error("dead letter %s: %s: %s", record.id, record.exc_type, record.message)
    except Exception:  # bookkeeping must never hide the failure it records
        log.exception("could not record dead letter %s", record.id)


def shard_of(args: Any, kwargs: Any) -> str:
    """The shard id a lane task was called for, if its arguments are well-formed enough to tell."""
    value = args[0] if isinstance(args, (list, tuple)) and args else (kwargs or {}).get("shard_id", "")
    return value if isinstance(value, str) else ""


def dead_letter_task(
    dead_letters: DeadLetters, task_name: str, args: Any, kwargs: Any, exc: BaseException, *, deliveries: int,
    worker: str,
) -> DeadLetter:
    lane = _lane_name(task_name)
    shard_id = shard_of(args, kwargs)
    record = DeadLetter(
        id=record_id(TASK, lane, shard_id) if shard_id else record_id(MESSAGE, lane, task_id=str(id(exc))),
        kind=TASK if shard_id else MESSAGE,
        lane=lane,
        task=task_name,
        shard_id=shard_id,
        args=list(args) if isinstance(args, (list, tuple)) else [repr(args)],
        kwargs=dict(kwargs) if isinstance(kwargs, dict) else {},
        deliveries=deliveries,
        worker=worker,
        **exception_fields(exc),
    )
    _store(dead_letters, record)
    return record


def dead_letter_samples(
    dead_letters: DeadLetters,
    task_name: str,
    args: Any,
    kwargs: Any,
    poisoned: tuple[tuple[str, BaseException], ...],
    *,
    deliveries: int,
    worker: str,
) -> None:
    lane = _lane_name(task_name)
    shard_id = shard_of(args, kwargs)
    for sample_id, exc in poisoned:
        _store(
            dead_letters,
            DeadLetter(
                id=record_id(SAMPLE, lane, shard_id, [sample_id]),
                kind=SAMPLE,
                lane=lane,
                task=task_name,
                shard_id=shard_id,
                args=list(args),
                kwargs=dict(kwargs),
                sample_ids=[sample_id],
                deliveries=deliveries,
                worker=worker,
                **exception_fields(exc),
            )
        )


def dead_letter_message(dead_letters: DeadLetters, message: Any, exc: BaseException | None, reason: str) -> None:
    headers = getattr(message, "headers", None) or {}
    delivery = getattr(message, "delivery_info", None) or {}
    task_id = str(headers.get("id") or getattr(message, "delivery_tag", "") or "?")
    lane = str(delivery.get("routing_key") or "")
    body = getattr(message, "body", b"")
    if isinstance(body, bytes):
        body = body.decode("utf-8", "replace")
    fields: ExceptionFields = (
        exception_fields(exc) if exc is not None else {"exc_type": reason, "message": reason, "traceback": ""}
    )
    _store(
        dead_letters,
        DeadLetter(
            id=record_id(MESSAGE, lane, task_id=task_id),
            kind=MESSAGE,
            lane=lane or UNKNOWN_LANE,
            task=str(headers.get("task") or ""),
            args=[str(body)[:BODY_CHARS]],
            kwargs={"content_type": str(getattr(message, "content_type", "")), "reason": reason},
            **fields,
        )
    )


class WorkerConsumer(Consumer):
    """Celery's consumer, recording a dead letter for each message it cannot run before dropping it, and
    surviving an ack that lands on a channel closed by a broker outage."""

    def update_strategies(self):
        # A task that finishes while the broker is down acks on a channel whose connection is gone; kombu then
        # fails with AttributeError (no connection info) instead of a connection error, and that error, raised
        # while the consumer restarts, takes the whole worker down. Counted as a connection error, the failed
        # ack is logged and the message stays unacked in Redis: it comes back after the visibility timeout and
        # its task finds its output stored.
        errors = self.connection_errors
        self.connection_errors = (*errors, AttributeError)
        try:
            super().update_strategies()
        finally:
            self.connection_errors = errors

    def on_connection_error_after_connected(self, exc):
        # Closing the broken connection makes kombu restore this worker's unacked messages through a connection
        # it has already released, which fails with AttributeError and would be taken for an unrecoverable
        # error (the worker exits). Those messages are in Redis's unacked set either way and come back after the
        # visibility timeout; what matters is that the consumer reconnects.
        try:
            super().on_connection_error_after_connected(exc)
        except AttributeError as error:
            log.warning("broker connection lost with messages in flight (%s); reconnecting", error)

    def _dead_letter(self, message: Any, exc: BaseException | None, reason: str) -> None:
        try:
            dead_letters = self.app.runtime().dead_letters
        except RuntimeError:  # bookkeeping must never hide the failure it records
            log.exception("could not record a dead letter for a %s", reason)
            return
        dead_letter_message(dead_letters, message, exc, reason)

    def on_decode_error(self, message, exc):
        self._dead_letter(message, exc, "undecodable message")
        return super().on_decode_error(message, exc)

    def on_unknown_message(self, body, message):
        self._dead_letter(message, None, "message without task headers")
        return super().on_unknown_message(body, message)

    def on_unknown_task(self, body, message, exc):
        self._dead_letter(message, exc, "unknown task")
        return super().on_unknown_task(body, message, exc)

    def on_invalid_task(self, body, message, exc):
        self._dead_letter(message, exc, "invalid task message")
        return super().on_invalid_task(body, message, exc)
