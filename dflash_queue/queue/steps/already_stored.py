"""A shard whose output is already stored is not computed again: the lane says whether it is, and what a skip
returns (`ResidentLane.already_stored`); this step asks, once, before the lane runs, for every lane. A requeued dead
letter (`redo`) is run whatever is stored: the lane writes the shard again with what it lacks."""

from __future__ import annotations

from dflash_queue.lanes.registry import LaneSummary, ResidentLane
from dflash_queue.queue.steps.lane_message import LaneMessage


def run_unless_stored(lane: ResidentLane, message: LaneMessage) -> LaneSummary:
    if not message.redo:
        stored = lane.already_stored(message.shard_id, epoch=message.epoch)
        if stored is not None:
            return stored
    return lane.run(message.shard_id, redo=message.redo, epoch=message.epoch)
