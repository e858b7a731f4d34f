"""The fault tests' faults that strike a task before its work: a delay, a kill of the worker (dflash_queue.faults;
nothing unless DFQ_INJECT_FAULTS is set)."""

from __future__ import annotations

from dflash_queue import faults


def strike_before_task(shard_id: str) -> None:
    faults.task_delay()
    faults.maybe_kill(shard_id)
