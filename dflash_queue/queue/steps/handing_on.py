"""A shard its lane stored moves on: its state (the lane's finished state, in the ledger or its epoch's states),
its place in the store order (the final lane: a live dataset's ranks take shards in that order), its stale dead
letters settled, and a message to the next lane."""

from __future__ import annotations

from typing import Protocol

from dflash_queue.deadletters import DeadLetters
from dflash_queue.lanes.registry import FINAL_LANE, LaneSpec
from dflash_queue.queue.steps.lane_message import LaneMessage
from dflash_queue.runstate.ledger import Ledger
from dflash_queue.runstate.window import ShardWindow


class SendToLane(Protocol):
    def __call__(
        self, lane: str, shard_id: str, num_samples: int, fingerprint: str, *, redo: bool = False, epoch: int = 0
    ) -> None: ...


class HandOn:
    def __init__(
        self, ledger: Ledger, consumption: ShardWindow, dead_letters: DeadLetters, send_to_lane: SendToLane
    ) -> None:
        self.ledger = ledger
        self.consumption = consumption
        self.dead_letters = dead_letters
        self.send_to_lane = send_to_lane

    def __call__(self, spec: LaneSpec, message: LaneMessage, handed_on: int) -> None:
        """`handed_on`: the samples the next lane receives."""
        shard_id, epoch = message.shard_id, message.epoch
        if spec is FINAL_LANE:
            self.consumption.record_stored(epoch, shard_id)
        if epoch:
            self.consumption.set_epoch_state(epoch, shard_id, spec.finished_state)
        else:
            self.ledger.set_state(shard_id, spec.finished_state)
        self.dead_letters.settle(spec.name, shard_id)
        if spec.next_lane is not None:
            self.send_to_lane(spec.next_lane, shard_id, handed_on, message.fingerprint, redo=message.redo)
