"""Thin Celery tasks: check the message, call the lane, record progress, chain the next lane.

Messages carry references only: a shard id, its sample count and the config fingerprint.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

from celery import Task
from celery.exceptions import Reject
from celery.utils.log import get_task_logger

from dflash_queue import ledger as states
from dflash_queue.errors import EngineUnavailable, FingerprintMismatch, StorageUnavailable, WorkerShuttingDown
from dflash_queue.quality.gate import gate_summary
from dflash_queue.queue import runtime
from dflash_queue.queue.app import EXTRACT_QUEUE, EXTRACT_TASK, GENERATE_TASK, app
from dflash_queue.queue.busy import BusyClock

log = get_task_logger(__name__)
# Busy time per lane in this worker process, recorded as `{lane}_busy_ms` next to the lane's counters.
BUSY = {"generate": BusyClock(), "extract": BusyClock()}


def _check_fingerprint(rt: runtime.WorkerRuntime, fingerprint: str, shard_id: str) -> None:
    if fingerprint != rt.fingerprint:
        raise FingerprintMismatch(
            f"shard {shard_id}: message fingerprint {fingerprint} != worker config fingerprint {rt.fingerprint} "
            f"({rt.config.source}); the worker runs a different model or settings than the producer"
        )


class LaneTask(Task):
    """Records a failed shard in the ledger so that runs and operators see it instead of waiting forever.

    A dead engine is not the shard's fault: the message goes back to the queue for a healthy worker, and this
    worker stops instead of failing every task it would take next.
    """

    def __call__(self, *args, **kwargs):
        try:
            return super().__call__(*args, **kwargs)
        except EngineUnavailable as exc:
            runtime.current().request_stop(f"{type(exc).__name__}: {exc}")
            raise Reject(str(exc), requeue=True) from exc

    def on_failure(self, exc, task_id, args, kwargs, einfo) -> None:
        shard_id = args[0] if args else kwargs.get("shard_id", "?")
        try:
            runtime.current().ledger.mark_failed(shard_id, f"{self.name}: {type(exc).__name__}: {exc}")
        except Exception:  # never let bookkeeping hide the original error
            log.exception("could not record the failure of shard %s", shard_id)

    def on_retry(self, exc, task_id, args, kwargs, einfo) -> None:
        try:
            runtime.current().ledger.add({"storage_retries": 1})
        except Exception:
            log.exception("could not count a retry")


STORAGE_RETRY_MAX_DELAY_S = 120.0


@contextmanager
def _lane_outcomes(task: Task, rt: runtime.WorkerRuntime, shard_id: str) -> Iterator[None]:
    """Storage outages become delayed retries; a shutdown before the work began puts the message back."""
    try:
        yield
    except WorkerShuttingDown as exc:
        log.info("%s: requeued", exc)
        raise Reject(str(exc), requeue=True) from None
    except StorageUnavailable as exc:
        attempt = task.request.retries
        delay = min(2.0 * 2**attempt, STORAGE_RETRY_MAX_DELAY_S) * random.uniform(0.5, 1.0)
        log.warning("shard %s: storage unavailable (retry %d in %.1f s): %s", shard_id, attempt + 1, delay, exc)
        raise task.retry(exc=exc, countdown=delay, max_retries=rt.config.storage.unavailable_task_retries)


@app.task(name=GENERATE_TASK, base=LaneTask, bind=True)
def generate_shard(self: Task, shard_id: str, num_samples: int, fingerprint: str) -> None:
    rt = runtime.current()
    _check_fingerprint(rt, fingerprint, shard_id)
    with _lane_outcomes(self, rt, shard_id), BUSY["generate"].task() as timing:
        summary = rt.lane("generate").run(shard_id)
    if not summary.skipped:
        rt.ledger.add({**summary.counters(), "generate_busy_ms": timing.busy_ms})
    rt.ledger.set_state(shard_id, states.GENERATED)
    extract_shard.apply_async(args=(shard_id, summary.kept, fingerprint), queue=EXTRACT_QUEUE)
    log.info(
        "generated shard %s: %d samples, %d completion tokens; quality gate: %s%s",
        shard_id,
        summary.num_samples,
        summary.completion_tokens,
        "; ".join(gate_summary(summary.gate)),
        " (already stored)" if summary.skipped else "",
    )


@app.task(name=EXTRACT_TASK, base=LaneTask, bind=True)
def extract_shard(self: Task, shard_id: str, num_samples: int, fingerprint: str) -> None:
    rt = runtime.current()
    _check_fingerprint(rt, fingerprint, shard_id)
    with _lane_outcomes(self, rt, shard_id), BUSY["extract"].task() as timing:
        summary = rt.lane("extract").run(shard_id)
    if not summary.skipped:
        rt.ledger.add({**summary.counters(), "extract_busy_ms": timing.busy_ms})
    rt.ledger.set_state(shard_id, states.DONE)
    log.info(
        "extracted shard %s: %d samples, %d tokens, %d bytes%s",
        shard_id,
        summary.num_samples,
        summary.num_tokens,
        summary.num_bytes,
        " (already stored)" if summary.skipped else "",
    )
