"""An extract worker process a reference audit halted stops (see lanes/audit.py): the audit of a shard it stored
found states that are not the checkpoint's forward, so whatever it computes next is suspect too.

The audit runs elsewhere (an audit worker) and records the halt in the broker under this process's incarnation
(runstate/audits.py). The worker looks before each task it starts (the task goes back to the queue, unrun, for a
healthy worker) and on every heartbeat (an idle worker stops too), then stops with exit status 78, which the
shipped systemd units do not restart on, and a stop record `status` shows. A shard it stores meanwhile (a task
already past the look) is suspect at once.
"""

from __future__ import annotations

import logging

from dflash_queue.errors import WorkerShuttingDown
from dflash_queue.queue.runtime import WorkerRuntime

log = logging.getLogger(__name__)


def halted_reason(rt: WorkerRuntime) -> str:
    """Why an audit halted this worker process ("" when none did, or the broker cannot say now)."""
    if not rt.incarnation or not rt.config.audit.enabled:
        return ""
    try:
        return rt.audits.halted(rt.incarnation)
    except Exception:  # the broker's outage is the heartbeat's and the tasks' concern; looked at again later
        log.exception("could not ask whether an audit halted this worker")
        return ""


def stop_if_halted(rt: WorkerRuntime, lane: str) -> bool:
    """Stop this worker (exit 78) when an audit halted it; whether it did."""
    reason = halted_reason(rt)
    if reason:
        rt.stop_for_failed_audit(lane, reason)
    return bool(reason)


def refuse_if_halted(rt: WorkerRuntime, lane: str, shard_id: str) -> None:
    """Before a task computes: a halted worker hands the shard back to the queue and stops."""
    if stop_if_halted(rt, lane):
        raise WorkerShuttingDown(f"shard {shard_id}: this worker was halted by a reference audit")
