"""Dead letters of a lane task on a real redis-server: the failed task's record, its shard's failed state and
window place, and one record per poison sample."""

from __future__ import annotations

import pytest
import redis

from dflash_queue.deadletters import SAMPLE, TASK, DeadLetters
from dflash_queue.queue.steps.dead_letters import DeadLettering
from dflash_queue.queue.steps.lane_message import LaneMessage
from dflash_queue.runstate.ledger import Ledger
from dflash_queue.runstate.shard_states import FAILED
from dflash_queue.runstate.window import ShardWindow


@pytest.fixture
def parts(redis_url):
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    ledger, window, dead = Ledger(client, "r"), ShardWindow(client, "r"), DeadLetters(client, "r")
    return DeadLettering(dead, ledger, window), ledger, window, dead


def test_a_failed_task_is_recorded_its_shard_failed_and_its_window_place_given_back(parts):
    dead_lettering, ledger, window, dead = parts
    window.take_place(0, "s1", 4)
    dead_lettering.task_failed(
        "dfq.extract", ("s1", 8, "fp"), {"redo": False}, ValueError("bad"), deliveries=2, worker="w1"
    )
    (record,) = dead.all()
    assert (record.kind, record.lane, record.shard_id, record.exc_type) == (TASK, "extract", "s1", "ValueError")
    assert (record.args, record.kwargs, record.deliveries, record.worker) == (["s1", 8, "fp"], {"redo": False}, 2, "w1")
    assert ledger.states() == {"s1": FAILED} and ledger.failure("s1") == "dfq.extract: ValueError: bad"
    assert window.places() == []


def test_a_later_epochs_failure_is_kept_with_that_epoch_not_the_run(parts):
    dead_lettering, ledger, window, dead = parts
    window.take_place(2, "s1", 4)
    kwargs = {"redo": False, "epoch": 2}
    dead_lettering.task_failed("dfq.extract", ("s1", 8, "fp"), kwargs, ValueError("bad"), deliveries=1, worker="w1")
    assert window.epoch_states(2) == {"s1": FAILED} and ledger.states() == {}
    assert window.places() == [] and dead.count() == 1


def test_a_message_without_a_shard_is_recorded_and_touches_no_shard(parts):
    dead_lettering, ledger, window, dead = parts
    dead_lettering.task_failed("dfq.extract", (), {}, ValueError("bad"), deliveries=1, worker="w1")
    assert dead.count() == 1 and ledger.states() == {}


def test_each_poison_sample_has_a_record_of_its_own_and_none_means_none(parts):
    dead_lettering, _, _, dead = parts
    message = LaneMessage("s1", 8, "fp")
    dead_lettering.samples_poisoned("dfq.generate", message, (), deliveries=1, worker="w1")
    assert dead.count() == 0
    poisoned = (("a", RuntimeError("boom")), ("b", RuntimeError("bang")))
    dead_lettering.samples_poisoned("dfq.generate", message, poisoned, deliveries=1, worker="w1")
    records = sorted(dead.all(), key=lambda r: r.sample_ids)
    assert [(r.kind, r.lane, r.shard_id, r.sample_ids) for r in records] == [
        (SAMPLE, "generate", "s1", ["a"]),
        (SAMPLE, "generate", "s1", ["b"]),
    ]
    assert records[0].args == ["s1", 8, "fp"] and records[0].kwargs == {"redo": False}
