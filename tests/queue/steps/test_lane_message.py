"""The shape of a lane task's message, as sent, re-sent and dead-lettered."""

from __future__ import annotations

from dflash_queue.queue.steps.lane_message import LaneMessage


def test_epoch_zero_messages_carry_no_epoch_and_later_epochs_do():
    assert LaneMessage("s1", 8, "fp").args == ("s1", 8, "fp")
    assert LaneMessage("s1", 8, "fp").kwargs == {"redo": False}
    assert LaneMessage("s1", 8, "fp", redo=True).kwargs == {"redo": True}
    assert LaneMessage("s1", 8, "fp", epoch=2).kwargs == {"redo": False, "epoch": 2}
