"""Thin Celery tasks: check the message, call the lane, record progress, hand the shard to the next lane.

One generic task body serves every lane of the registry (dflash_queue.lanes.registry), registered under the
lane's task name. Messages carry references only: a shard id, its sample count, the config fingerprint, and
`redo` (set by a requeued dead letter: write the shard again with the samples it lacks).

Exactly-once output from at-least-once delivery: output keys derive from the shard id, a task whose output
exists completes without recomputing, and outputs are written whole (temp file + rename, or one object PUT),
so a task delivered twice, even to two workers at once, writes the same shard, never half or two of it; its
counters are added once.

Each concern is a step of its own (dflash_queue/queue/steps/), composed here in this order. Around the task body
(`LaneTask.__call__`), outermost first:

1. deliveries: the delivery is counted; past broker.max_deliveries the task is dead-lettered unrun;
2. injected faults (the fault tests only): a delay, a kill;
3. window requeue: WindowFull sends the task again, to the back of the queue, and acknowledges this one;
4. hand back: a dead engine, failed checks on too many recent shards, or shutdown puts the message back unrun.

Celery's handlers: a task that fails for good is dead-lettered (`on_failure`); a retry is counted (`on_retry`).

The body (`run_lane_task`):

5. fingerprint: a message made under other settings is refused;
6. transient retries: storage outages and broken connections (in 7 and 8) become delayed retries;
7. already stored: a shard whose output the lane says is stored is not computed again (unless `redo`);
8. the lane, timed with 7 by the lane's busy clock;
9. dead letters of the samples the lane left out;
10. counting: the shard's counters added once (none for a skip), its maxima recorded;
11. audit hand-off (the final lane): the stored shard recorded for the reference audit, sent to the audit lane when
    due (before 12: a shard shows done with its audit queued); a worker an audit halted takes no task
    (queue/audit_halt.py: checked before 6);
12. handing on: the shard's state moved on, its dead letters settled, a message to the next lane.
"""

from __future__ import annotations

from celery import Task
from celery.utils.log import get_task_logger

from dflash_queue.deadletters.recording import shard_of
from dflash_queue.lanes.registry import FINAL_LANE, LANES, LaneSpec, LaneSummary, lane_of_task
from dflash_queue.queue.app import app
from dflash_queue.queue.audit_halt import refuse_if_halted
from dflash_queue.queue.busy import BusyClock
from dflash_queue.queue.runtime import WorkerRuntime
from dflash_queue.queue.steps.already_stored import run_unless_stored
from dflash_queue.queue.steps.audit_handoff import AuditHandOff
from dflash_queue.queue.steps.counting import ShardCounters
from dflash_queue.queue.steps.dead_letters import DeadLettering
from dflash_queue.queue.steps.deliveries import DeliveryCount
from dflash_queue.queue.steps.fingerprint import check_fingerprint
from dflash_queue.queue.steps.hand_back import handing_back
from dflash_queue.queue.steps.handing_on import HandOn
from dflash_queue.queue.steps.injected_faults import strike_before_task
from dflash_queue.queue.steps.lane_message import LaneMessage
from dflash_queue.queue.steps.retries import count_retry, transient_retries
from dflash_queue.queue.steps.window_requeue import requeued_when_window_full

log = get_task_logger(__name__)
# Busy time per lane in this worker process, recorded as `{lane}_busy_ms` next to the lane's counters.
BUSY = {name: BusyClock() for name in LANES}


class LaneTask(Task):
    """The steps around a lane task's body (1 to 4 above) and Celery's failure and retry handlers.

    A task that fails for good (a permanent error, retries exhausted) is dead-lettered by `on_failure`; Celery then
    acks its message.
    """

    @property
    def runtime(self) -> WorkerRuntime:
        """This worker process's runtime (config, ledger, resident lane, dead letters)."""
        return app.runtime()

    def __call__(self, *args, **kwargs):
        rt = self.runtime
        spec = lane_of_task(self.name)
        shard_id = shard_of(args, kwargs)
        delivery = DeliveryCount(rt.ledger, rt.config.broker, self.request.id or "", self.request.retries or 0)
        self.request.deliveries = delivery.count()
        exceeded = delivery.limit_exceeded(self.request.deliveries)
        if exceeded is not None:
            self._dead_letter(rt, exceeded, args, kwargs)
            return None
        strike_before_task(shard_id)

        def send_again() -> None:
            self.apply_async(args=args, kwargs=kwargs, queue=spec.queue if spec else None)

        with (
            requeued_when_window_full(send_again, delivery.uncount),
            handing_back(rt, spec.name if spec else self.name, shard_id, delivery.uncount),
        ):
            return super().__call__(*args, **kwargs)
        return None  # WindowFull: sent again

    def dead_lettering(self, rt: WorkerRuntime) -> DeadLettering:
        return DeadLettering(rt.dead_letters, rt.ledger, rt.consumption)

    def _dead_letter(self, rt: WorkerRuntime, exc: BaseException, args, kwargs) -> None:
        self.dead_lettering(rt).task_failed(
            self.name, args, kwargs, exc, deliveries=self.deliveries, worker=self.request.hostname or ""
        )

    @property
    def deliveries(self) -> int:
        """How many times this task's message was delivered (counted in `__call__`)."""
        return getattr(self.request, "deliveries", 0)

    def on_failure(self, exc, task_id, args, kwargs, einfo) -> None:
        self._dead_letter(self.runtime, exc, args, kwargs)

    def on_retry(self, exc, task_id, args, kwargs, einfo) -> None:
        count_retry(self.runtime.ledger, exc)


def run_lane_task(task: LaneTask, spec: LaneSpec, message: LaneMessage) -> LaneSummary:
    """One shard through one lane (steps 5 to 11 above). A later epoch (a shard extracted again for training)
    keeps its states apart from the run's."""
    rt = task.runtime
    shard_id = message.shard_id
    check_fingerprint(message, rt.fingerprint, rt.config.source)
    if spec is FINAL_LANE:
        refuse_if_halted(rt, spec.name, shard_id)
    with transient_retries(task, rt.config.broker, rt.config.storage, shard_id), BUSY[spec.name].task() as timing:
        summary = run_unless_stored(rt.lane(spec.name), message)
    task.dead_lettering(rt).samples_poisoned(
        task.name, message, summary.poisoned, deliveries=task.deliveries, worker=task.request.hostname or ""
    )
    counters = ShardCounters(rt.ledger)
    if not summary.skipped:
        rt.check_streak.passed()
        counts = {**summary.counters(), spec.busy_counter: timing.busy_ms}
        counters.count_once(spec.name, message, task.request.id, counts)
    counters.record_maxima(summary.maxima())
    if spec is FINAL_LANE and not summary.skipped:  # before the shard shows done: its audit is then queued
        lane = rt.lane(spec.name)
        storage = getattr(lane, "storage", None) or rt.storage
        assert storage is not None, "the final lane stores its shards somewhere"
        hand_off = AuditHandOff(rt.audits, storage, rt.config.audit, send_to_lane)
        hand_off(message, summary.handed_on, incarnation=rt.incarnation, node=rt.node, dtype=_computed_in(lane))
    HandOn(rt.ledger, rt.consumption, rt.dead_letters, send_to_lane)(spec, message, summary.handed_on)
    log.info("%s", summary.describe())
    return summary


def _computed_in(lane: object) -> str:
    """The dtype the lane's engine computes in ("bfloat16"), as the reference audit compares it."""
    dtype = getattr(getattr(lane, "extractor", None), "dtype", None)
    return str(dtype).removeprefix("torch.") if dtype is not None else ""


def _register(spec: LaneSpec) -> Task:
    def lane_task(
        self: LaneTask, shard_id: str, num_samples: int, fingerprint: str, redo: bool = False, epoch: int = 0
    ) -> None:
        run_lane_task(self, spec, LaneMessage(shard_id, num_samples, fingerprint, redo, epoch))

    lane_task.__name__ = lane_task.__qualname__ = f"{spec.name}_shard"
    return app.task(name=spec.task_name, base=LaneTask, bind=True)(lane_task)


# One task per lane, by lane name.
LANE_TASKS: dict[str, Task] = {name: _register(spec) for name, spec in LANES.items()}


def send_to_lane(
    lane: str, shard_id: str, num_samples: int, fingerprint: str, *, redo: bool = False, epoch: int = 0
) -> None:
    message = LaneMessage(shard_id, num_samples, fingerprint, redo, epoch)
    LANE_TASKS[lane].apply_async(args=message.args, kwargs=message.kwargs, queue=LANES[lane].queue)
