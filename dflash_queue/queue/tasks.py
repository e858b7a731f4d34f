"""Thin Celery tasks: check the message, call the lane, record progress, hand the shard to the next lane.

One generic task body serves every lane of the registry (dflash_queue.lanes.registry), registered under the
lane's task name. Messages carry references only: a shard id, its sample count, the config fingerprint, and
`redo` (set by a requeued dead letter: write the shard again with the samples it lacks).

Exactly-once output from at-least-once delivery: output keys derive from the shard id, a task whose output
exists completes without recomputing, and outputs are written whole (temp file + rename, or one object PUT),
so a task delivered twice, even to two workers at once, writes the same shard, never half or two of it; its
counters are added once.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import redis
from celery import Task
from celery.exceptions import Reject
from celery.utils.log import get_task_logger
from celery.utils.time import get_exponential_backoff_interval

from dflash_queue import faults
from dflash_queue.deadletters.recording import dead_letter_samples, dead_letter_task, shard_of
from dflash_queue.errors import (
    DflashQueueError,
    EngineUnavailable,
    FingerprintMismatch,
    StorageUnavailable,
    TransientIOError,
    WindowFull,
    WorkerShuttingDown,
)
from dflash_queue.lanes.registry import FINAL_LANE, LANES, LaneSpec, LaneSummary, lane_of_task
from dflash_queue.queue.app import app
from dflash_queue.queue.busy import BusyClock
from dflash_queue.queue.check_streak import STATE_CHECK_FAILURES
from dflash_queue.queue.runtime import WorkerRuntime
from dflash_queue.runstate.shard_states import FAILED

log = get_task_logger(__name__)
# Busy time per lane in this worker process, recorded as `{lane}_busy_ms` next to the lane's counters.
BUSY = {name: BusyClock() for name in LANES}


def _check_fingerprint(rt: WorkerRuntime, fingerprint: str, shard_id: str) -> None:
    if fingerprint != rt.fingerprint:
        raise FingerprintMismatch(
            f"shard {shard_id}: message fingerprint {fingerprint} != worker config fingerprint {rt.fingerprint} "
            f"({rt.config.source}); the worker runs a different model or settings than the producer"
        )


class LaneTask(Task):
    """Delivery counting, dead letters and transient retries around a lane task.

    Each delivery is counted in Redis before the work starts, because a worker killed by the kernel (OOM,
    segfault, SIGKILL) runs no failure handler: the message simply comes back. A task delivered more than
    `broker.max_deliveries` times is dead-lettered unrun. A task that fails for good (a permanent error,
    retries exhausted) is dead-lettered by `on_failure`; Celery then acks its message.

    A dead engine is not the shard's fault: the message goes back to the queue for a healthy worker, and this
    worker stops instead of failing every task it would take next. Nor is an engine that fails its state checks on
    `extract.stop_after_failed_checks` shards in a row: the shard that completes the streak goes back to the
    queue as well, and the worker stops for good (queue/check_streak.py).
    """

    @property
    def runtime(self) -> WorkerRuntime:
        """This worker process's runtime (config, ledger, resident lane, dead letters)."""
        return app.runtime()

    def __call__(self, *args, **kwargs):
        rt = self.runtime
        deliveries = rt.ledger.count_delivery(self.request.id or "", self.request.retries or 0)
        self.request.deliveries = deliveries
        if deliveries > rt.config.broker.max_deliveries:
            return self._give_up(rt, args, kwargs, deliveries)
        faults.task_delay()
        faults.maybe_kill(shard_of(args, kwargs))
        try:
            return super().__call__(*args, **kwargs)
        except EngineUnavailable as exc:
            self._not_counted(rt)
            rt.request_stop(f"{type(exc).__name__}: {exc}")
            raise Reject(str(exc), requeue=True) from exc
        except STATE_CHECK_FAILURES as exc:
            if not rt.check_streak.failed(shard_of(args, kwargs), exc):
                raise  # a dead letter (on_failure)
            self._not_counted(rt)
            spec = lane_of_task(self.name)
            rt.stop_for_failed_checks(spec.name if spec else self.name)
            log.error("shard %s handed back: %s: %s", shard_of(args, kwargs), type(exc).__name__, exc)
            raise Reject(str(exc), requeue=True) from exc
        except WorkerShuttingDown as exc:
            self._not_counted(rt)
            log.info("%s: requeued", exc)
            raise Reject(str(exc), requeue=True) from None
        except WindowFull as exc:
            # A new message at the back of the queue, then this one acknowledged: shards behind it get their turn,
            # and a wait of hours never outlives the broker's visibility timeout.
            self._not_counted(rt)
            spec = lane_of_task(self.name)
            self.apply_async(args=args, kwargs=kwargs, queue=spec.queue if spec else None)
            log.info("%s", exc)
            return None

    def _give_up(self, rt: WorkerRuntime, args, kwargs, deliveries: int) -> None:
        exc = DeliveryLimitExceeded(
            f"delivered {deliveries} times (broker.max_deliveries = {rt.config.broker.max_deliveries}); the "
            "workers that ran it died each time (out of memory, a crash, a kill): see their logs"
        )
        self._dead_letter(rt, exc, args, kwargs)

    def _not_counted(self, rt: WorkerRuntime) -> None:
        """A delivery handed back unrun (shutdown, dead engine) is not the task's fault: uncount it."""
        try:
            rt.ledger.count_delivery(self.request.id or "", self.request.retries or 0, by=-1)
        except Exception:
            log.exception("could not uncount a requeued delivery")

    def _dead_letter(self, rt: WorkerRuntime, exc: BaseException, args, kwargs) -> None:
        epoch = int((kwargs or {}).get("epoch", 0))
        record = dead_letter_task(
            rt.dead_letters,
            self.name,
            args,
            kwargs,
            exc,
            deliveries=getattr(self.request, "deliveries", 0),
            worker=self.request.hostname or "",
        )
        if record.shard_id:
            error = f"{self.name}: {type(exc).__name__}: {exc}"
            try:
                if epoch:
                    rt.consumption.set_epoch_state(epoch, record.shard_id, FAILED, error)
                else:
                    rt.ledger.mark_failed(record.shard_id, error)
                # A shard that will not be stored gives its place in the window back.
                rt.consumption.give_back_place(epoch, record.shard_id)
            except Exception:  # never let bookkeeping hide the original error
                log.exception("could not record the failure of shard %s", record.shard_id)

    def on_failure(self, exc, task_id, args, kwargs, einfo) -> None:
        self._dead_letter(self.runtime, exc, args, kwargs)

    def on_retry(self, exc, task_id, args, kwargs, einfo) -> None:
        name = "storage_retries" if isinstance(exc, StorageUnavailable) else "transient_retries"
        try:
            self.runtime.ledger.add({name: 1})
        except Exception:
            log.exception("could not count a retry")


class DeliveryLimitExceeded(DflashQueueError):
    """The task was delivered more often than broker.max_deliveries allows."""


# Transient: the broker or a connection blinked, a local file system was full or failing. Storage outages have
# their own (longer) retry budget.
TRANSIENT_ERRORS = (redis.ConnectionError, redis.TimeoutError, ConnectionError, TimeoutError, TransientIOError)


def backoff_s(attempt: int, cap_s: float) -> int:
    """Celery's exponential backoff with full jitter (what `retry_backoff` and `retry_jitter` give autoretried
    tasks): a random delay up to 2 s, 4 s, 8 s ... capped at cap_s, and at least 1 s. The retries here are
    explicit, since storage outages and broken connections have budgets of their own."""
    return max(1, get_exponential_backoff_interval(factor=2, retries=attempt, maximum=int(cap_s), full_jitter=True))


@contextmanager
def _transient_retries(task: Task, rt: WorkerRuntime, shard_id: str) -> Iterator[None]:
    """Storage outages and broken connections become delayed retries; anything else fails the task."""
    broker = rt.config.broker
    try:
        yield
    except StorageUnavailable as exc:
        delay = backoff_s(task.request.retries, broker.retry_backoff_max_s)
        log.warning("shard %s: storage unavailable (retry %d in %.1f s): %s", shard_id, task.request.retries + 1, delay, exc)
        raise task.retry(exc=exc, countdown=delay, max_retries=rt.config.storage.unavailable_task_retries) from exc
    except TRANSIENT_ERRORS as exc:
        delay = backoff_s(task.request.retries, broker.retry_backoff_max_s)
        log.warning("shard %s: %s (retry %d in %.1f s): %s", shard_id, type(exc).__name__, task.request.retries + 1, delay, exc)
        raise task.retry(exc=exc, countdown=delay, max_retries=broker.transient_retries) from exc


def _count_once(
    rt: WorkerRuntime, task: Task, lane: str, shard_id: str, redo: bool, epoch: int, counts: dict
) -> None:
    """Counters of one shard's output, once: a second delivery that wrote the same output adds nothing."""
    token = f"{lane}:{shard_id}" + (f":epoch:{epoch}" if epoch else "") + (f":redo:{task.request.id}" if redo else "")
    rt.ledger.add_once(token, counts)


def _dead_letter_poisoned(task: LaneTask, args: tuple, kwargs: dict, poisoned) -> None:
    if poisoned:
        dead_letter_samples(
            task.runtime.dead_letters,
            task.name,
            args,
            kwargs,
            poisoned,
            deliveries=getattr(task.request, "deliveries", 0),
            worker=task.request.hostname or "",
        )


def run_lane_task(
    task: LaneTask,
    spec: LaneSpec,
    shard_id: str,
    num_samples: int,
    fingerprint: str,
    redo: bool = False,
    epoch: int = 0,
) -> LaneSummary:
    """One shard through one lane: run it, dead-letter its poison samples, count it once, move its state on,
    settle its dead letters, and hand it to the next lane. A later epoch (a shard extracted again for training)
    keeps its states apart from the run's."""
    rt = task.runtime
    _check_fingerprint(rt, fingerprint, shard_id)
    with _transient_retries(task, rt, shard_id), BUSY[spec.name].task() as timing:
        summary = rt.lane(spec.name).run(shard_id, redo=redo, epoch=epoch)
    _dead_letter_poisoned(task, (shard_id, num_samples, fingerprint), _lane_kwargs(redo, epoch), summary.poisoned)
    if not summary.skipped:
        rt.check_streak.passed()
        counts = {**summary.counters(), spec.busy_counter: timing.busy_ms}
        _count_once(rt, task, spec.name, shard_id, redo, epoch, counts)
    for name, value in summary.maxima().items():
        rt.ledger.record_max(name, value)
    if spec is FINAL_LANE:
        rt.consumption.record_stored(epoch, shard_id)  # a live dataset's ranks take shards in this order
    if epoch:
        rt.consumption.set_epoch_state(epoch, shard_id, spec.finished_state)
    else:
        rt.ledger.set_state(shard_id, spec.finished_state)
    rt.dead_letters.settle(spec.name, shard_id)
    if spec.next_lane is not None:
        send_to_lane(spec.next_lane, shard_id, summary.handed_on, fingerprint, redo=redo)
    log.info("%s", summary.describe())
    return summary


def _register(spec: LaneSpec) -> Task:
    def lane_task(
        self: LaneTask, shard_id: str, num_samples: int, fingerprint: str, redo: bool = False, epoch: int = 0
    ) -> None:
        run_lane_task(self, spec, shard_id, num_samples, fingerprint, redo, epoch)

    lane_task.__name__ = lane_task.__qualname__ = f"{spec.name}_shard"
    return app.task(name=spec.task_name, base=LaneTask, bind=True)(lane_task)


# One task per lane, by lane name.
LANE_TASKS: dict[str, Task] = {name: _register(spec) for name, spec in LANES.items()}


def _lane_kwargs(redo: bool, epoch: int) -> dict:
    """A message's keyword arguments: `epoch` only for a later epoch, so epoch 0's messages stay as they were."""
    return {"redo": redo, "epoch": epoch} if epoch else {"redo": redo}


def send_to_lane(
    lane: str, shard_id: str, num_samples: int, fingerprint: str, *, redo: bool = False, epoch: int = 0
) -> None:
    LANE_TASKS[lane].apply_async(
        args=(shard_id, num_samples, fingerprint), kwargs=_lane_kwargs(redo, epoch), queue=LANES[lane].queue
    )
