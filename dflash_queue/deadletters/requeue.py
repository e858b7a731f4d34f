"""Requeueing dead letters once their cause is fixed.

* A failed task is sent again for its shard, with the current config's fingerprint (the operator may have
  fixed the cause in the config) and the shard's sample count.
* Poison samples are requeued per shard: the shard's lane task runs again with `redo`, which writes the shard
  again with the samples it lacks (the generate lane generates only those; the extract lane re-extracts the
  shard). Every poison record of that shard and lane is taken with it, since the redo covers them all.
* A message that could not be run has nothing to send; it stays until purged.

Each record is taken from Redis atomically before its message is sent, so two operators requeueing at once
send it once; if the send fails, the record is put back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dflash_queue.config import RunConfig
from dflash_queue.deadletters import SAMPLE, TASK, DeadLetter, DeadLetters
from dflash_queue.lanes.registry import LANES
from dflash_queue.runstate.ledger import Ledger
from dflash_queue.runstate.window import ShardWindow

# send(task name, args, kwargs, queue)
Send = Callable[[str, tuple, dict, str], None]


@dataclass(frozen=True)
class RequeueOutcome:
    records: tuple[DeadLetter, ...]
    action: str  # "sent", "would send", "skipped", "gone"
    detail: str

    def line(self) -> str:
        ids = ", ".join(r.id for r in self.records)
        return f"{self.action}: {ids}: {self.detail}"


@dataclass(frozen=True)
class Job:
    """One message that settles one or more records."""

    lane: str
    shard_id: str
    redo: bool
    records: tuple[DeadLetter, ...]
    epoch: int = 0  # a later epoch's extraction (dflash_queue.live.epochs) is requeued in its epoch


def plan(records: Sequence[DeadLetter], all_records: Sequence[DeadLetter]) -> tuple[list[Job], list[DeadLetter]]:
    """(messages to send, records that cannot be requeued)."""
    jobs: list[Job] = []
    unrunnable: list[DeadLetter] = []
    redo_shards: set[tuple[str, str, int]] = set()
    for record in records:
        if not record.requeueable or record.lane not in LANES or not record.shard_id:
            unrunnable.append(record)
        elif record.kind == TASK:
            jobs.append(Job(record.lane, record.shard_id, False, (record,), _epoch(record)))
        elif record.kind == SAMPLE:
            redo_shards.add((record.lane, record.shard_id, _epoch(record)))
    for lane, shard_id, epoch in sorted(redo_shards):
        siblings = tuple(
            r
            for r in all_records
            if r.kind == SAMPLE and r.lane == lane and r.shard_id == shard_id and _epoch(r) == epoch
        )
        jobs.append(Job(lane, shard_id, True, siblings, epoch))
    return jobs, unrunnable


def requeue(
    run: RunConfig,
    fingerprint: str,
    dead_letters: DeadLetters,
    ledger: Ledger,
    records: Sequence[DeadLetter],
    send: Send,
    *,
    dry_run: bool = False,
) -> list[RequeueOutcome]:
    """Send the work of `records` again, each task with `fingerprint` (the run's Config.fingerprint()), and say what
    became of each; `dry_run` sends nothing."""
    jobs, unrunnable = plan(records, dead_letters.all())
    outcomes = [
        RequeueOutcome((r,), "skipped", f"a {r.kind} record has no task to send again; purge it when seen")
        for r in unrunnable
    ]
    sizes = ledger.shard_sizes()
    for job in jobs:
        spec = LANES[job.lane]
        task, queue = spec.task_name, spec.queue
        num_samples = sizes.get(job.shard_id) or _recorded_count(job.records)
        what = (
            f"{task}({job.shard_id}{', redo' if job.redo else ''}{f', epoch {job.epoch}' if job.epoch else ''}) "
            f"on queue {queue}"
        )
        if dry_run:
            outcomes.append(RequeueOutcome(job.records, "would send", what))
            continue
        taken = [r for r in (dead_letters.take(record.id) for record in job.records) if r is not None]
        if not taken:
            outcomes.append(RequeueOutcome(job.records, "gone", "already requeued or purged by someone else"))
            continue
        try:
            if job.epoch:
                ShardWindow(ledger.client, run.name).set_epoch_state(job.epoch, job.shard_id, spec.waiting_state)
            else:
                ledger.set_state(job.shard_id, spec.waiting_state)
            kwargs = {"redo": job.redo, "epoch": job.epoch} if job.epoch else {"redo": job.redo}
            send(task, (job.shard_id, num_samples, fingerprint), kwargs, queue)
        except Exception:
            for record in taken:
                dead_letters.put_back(record)
            raise
        outcomes.append(RequeueOutcome(tuple(taken), "sent", what))
    return outcomes


def _epoch(record: DeadLetter) -> int:
    return int(record.kwargs.get("epoch", 0) or 0)


def _recorded_count(records: Sequence[DeadLetter]) -> int:
    for record in records:
        if len(record.args) > 1 and isinstance(record.args[1], int):
            return record.args[1]
    return 0


def celery_send(app) -> Send:
    def send(task: str, args: tuple, kwargs: dict, queue: str) -> None:
        app.send_task(task, args=args, kwargs=kwargs, queue=queue)

    return send
