"""A training shard the extract lane stored: recorded for the reference audit (who stored it, in which order) and
sent to the audit lane when due (runstate/audits.py decides: the worker process's first shard, then one in
`audit.every_shards`, and one every `audit.every_minutes`). A shard stored anew is no longer suspect: its states
were computed again (`dflash-queue suspects reextract`); one stored by a worker an audit has halted is suspect at
once."""

from __future__ import annotations

from celery.utils.log import get_task_logger

from dflash_queue.lanes.config import AuditConfig
from dflash_queue.lanes.registry import AUDIT
from dflash_queue.queue.steps.handing_on import SendToLane
from dflash_queue.queue.steps.lane_message import LaneMessage
from dflash_queue.runstate.audits import AuditRecords
from dflash_queue.shards.suspects import SuspectMark, clear_mark, mark_suspect
from dflash_queue.storage import Storage

log = get_task_logger(__name__)


class AuditHandOff:
    def __init__(
        self, records: AuditRecords, storage: Storage, audit: AuditConfig, send_to_lane: SendToLane
    ) -> None:
        self.records = records
        self.storage = storage
        self.audit = audit
        self.send_to_lane = send_to_lane

    def __call__(self, message: LaneMessage, num_samples: int, *, incarnation: str, node: str, dtype: str) -> None:
        """The extract lane stored `message`'s shard (computed now, not found stored)."""
        shard_id, epoch = message.shard_id, message.epoch
        if self.records.clear_suspect(shard_id, epoch):
            log.info("shard %s (epoch %d) stored anew: no longer suspect", shard_id, epoch)
        clear_mark(self.storage, shard_id, epoch)
        if not self.audit.enabled:
            return
        verdict = self.records.record_stored(
            shard_id, epoch, incarnation, node, every_shards=self.audit.every_shards,
            every_s=60.0 * self.audit.every_minutes, dtype=dtype,
        )
        if verdict.halted:
            mark_suspect(self.storage, SuspectMark(shard_id, epoch, verdict.halted, "", node))
            log.error("shard %s stored by a worker a reference audit halted: suspect (%s)", shard_id, verdict.halted)
        elif verdict.audit_due:
            # A shard extracted again (`redo`) is new states: its audit counts anew, as its extraction does.
            self.send_to_lane(AUDIT.name, shard_id, num_samples, message.fingerprint, redo=message.redo, epoch=epoch)
