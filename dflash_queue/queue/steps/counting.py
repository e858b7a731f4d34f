"""A shard's counters added once, and its maxima recorded.

A second delivery that wrote the same output adds nothing: the counters go in under a token naming the lane, the
shard and its epoch (a requeued dead letter's, `redo`, also the task id: its fresh samples count anew).
"""

from __future__ import annotations

from collections.abc import Mapping

from dflash_queue.queue.steps.lane_message import LaneMessage
from dflash_queue.runstate.ledger import Ledger


def count_token(lane: str, message: LaneMessage, task_id: str | None) -> str:
    epoch = f":epoch:{message.epoch}" if message.epoch else ""
    redo = f":redo:{task_id}" if message.redo else ""
    return f"{lane}:{message.shard_id}{epoch}{redo}"


class ShardCounters:
    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    def count_once(self, lane: str, message: LaneMessage, task_id: str | None, counts: Mapping[str, int]) -> bool:
        """Whether the counts were added (False: this output was counted before)."""
        return self.ledger.add_once(count_token(lane, message, task_id), counts)

    def record_maxima(self, maxima: Mapping[str, float]) -> None:
        for name, value in maxima.items():
            self.ledger.record_max(name, value)
