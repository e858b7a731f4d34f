"""A stored shard moves on, on a real redis-server: its state, its store order, its dead letters, the next lane."""

from __future__ import annotations

import pytest
import redis

from dflash_queue.deadletters import TASK, DeadLetter, DeadLetters, exception_fields, record_id
from dflash_queue.lanes.registry import EXTRACT, GENERATE
from dflash_queue.queue.steps.handing_on import HandOn
from dflash_queue.queue.steps.lane_message import LaneMessage
from dflash_queue.runstate.ledger import Ledger
from dflash_queue.runstate.shard_states import DONE, GENERATED
from dflash_queue.runstate.window import ShardWindow


@pytest.fixture
def parts(redis_url):
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    ledger, window, dead = Ledger(client, "r"), ShardWindow(client, "r"), DeadLetters(client, "r")
    sent: list[tuple] = []

    def send(lane, shard_id, num_samples, fingerprint, *, redo=False, epoch=0):
        sent.append((lane, shard_id, num_samples, fingerprint, redo, epoch))

    return HandOn(ledger, window, dead, send), ledger, window, dead, sent


def stale_dead_letter(dead: DeadLetters, lane: str, shard_id: str) -> None:
    dead.add(DeadLetter(id=record_id(TASK, lane, shard_id), kind=TASK, lane=lane, task=f"dfq.{lane}",
                        shard_id=shard_id, **exception_fields(ValueError("earlier"))))


def test_a_generated_shard_goes_to_extract_with_the_samples_kept_and_its_redo(parts):
    hand_on, ledger, window, dead, sent = parts
    stale_dead_letter(dead, "generate", "s1")
    hand_on(GENERATE, LaneMessage("s1", 8, "fp", redo=True), 6)
    assert ledger.states() == {"s1": GENERATED} and dead.count() == 0
    assert sent == [("extract", "s1", 6, "fp", True, 0)]
    assert window.stored_since(0, 0) == []  # only the final lane's shards are in the store order


def test_an_extracted_shard_is_done_in_store_order_and_goes_nowhere(parts):
    hand_on, ledger, window, dead, sent = parts
    stale_dead_letter(dead, "extract", "s1")
    stale_dead_letter(dead, "generate", "s1")
    hand_on(EXTRACT, LaneMessage("s1", 8, "fp"), 8)
    hand_on(EXTRACT, LaneMessage("s2", 8, "fp"), 8)
    assert ledger.states() == {"s1": DONE, "s2": DONE} and sent == []
    assert [d.lane for d in dead.all()] == ["generate"]
    assert [shard for shard, _ in window.stored_since(0, 0)] == ["s1", "s2"]


def test_a_later_epochs_shard_keeps_its_state_apart_from_the_run(parts):
    hand_on, ledger, window, _, _ = parts
    hand_on(EXTRACT, LaneMessage("s1", 8, "fp", epoch=2), 8)
    assert window.epoch_states(2) == {"s1": DONE} and ledger.states() == {}
    assert [shard for shard, _ in window.stored_since(2, 0)] == ["s1"]
