"""The lane task asks the lane whether a shard's output is stored before it runs it, once, for every lane."""

from __future__ import annotations

from dataclasses import dataclass

from dflash_queue.queue.steps.already_stored import run_unless_stored
from dflash_queue.queue.steps.lane_message import LaneMessage


@dataclass(frozen=True)
class Summary:
    shard_id: str
    skipped: bool


class Lane:
    """A lane whose outputs are the set `stored`, recording what it is asked and run for."""

    def __init__(self, stored: set[tuple[str, int]]) -> None:
        self.stored = stored
        self.calls: list[tuple] = []

    def already_stored(self, shard_id: str, *, epoch: int = 0) -> Summary | None:
        self.calls.append(("already_stored", shard_id, epoch))
        return Summary(shard_id, skipped=True) if (shard_id, epoch) in self.stored else None

    def run(self, shard_id: str, *, redo: bool = False, epoch: int = 0) -> Summary:
        self.calls.append(("run", shard_id, redo, epoch))
        return Summary(shard_id, skipped=False)


def test_a_stored_output_is_the_skip_the_lane_describes_and_the_lane_does_not_run():
    lane = Lane({("s1", 0)})
    assert run_unless_stored(lane, LaneMessage("s1", 8, "fp")) == Summary("s1", skipped=True)
    assert lane.calls == [("already_stored", "s1", 0)]


def test_an_output_not_stored_for_the_messages_epoch_is_computed():
    lane = Lane({("s1", 0)})
    assert run_unless_stored(lane, LaneMessage("s1", 8, "fp", epoch=2)) == Summary("s1", skipped=False)
    assert lane.calls == [("already_stored", "s1", 2), ("run", "s1", False, 2)]


def test_a_requeued_dead_letter_runs_whatever_is_stored():
    lane = Lane({("s1", 0)})
    assert run_unless_stored(lane, LaneMessage("s1", 8, "fp", redo=True)) == Summary("s1", skipped=False)
    assert lane.calls == [("run", "s1", True, 0)]
