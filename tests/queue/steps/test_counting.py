"""A shard's counters added once on a real redis-server, whatever the deliveries; a redo's fresh samples anew."""

from __future__ import annotations

from dflash_queue.queue.steps.counting import ShardCounters
from dflash_queue.queue.steps.lane_message import LaneMessage
from dflash_queue.runstate.ledger import Ledger


def test_a_shard_is_counted_once_per_epoch_and_a_redo_once_per_task(redis_url):
    ledger = Ledger.from_url(redis_url, "r")
    counters = ShardCounters(ledger)
    message = LaneMessage("s1", 8, "fp")
    assert counters.count_once("extract", message, "t1", {"extract_shards": 1})
    assert not counters.count_once("extract", message, "t2", {"extract_shards": 1})  # a second delivery
    assert counters.count_once("generate", message, "t3", {"generate_shards": 1})  # another lane
    later = LaneMessage("s1", 8, "fp", epoch=1)
    assert counters.count_once("extract", later, "t4", {"extract_shards": 1})
    assert not counters.count_once("extract", later, "t5", {"extract_shards": 1})
    redo = LaneMessage("s1", 8, "fp", redo=True)
    assert counters.count_once("extract", redo, "t6", {"extract_shards": 1})
    assert not counters.count_once("extract", redo, "t6", {"extract_shards": 1})
    assert counters.count_once("extract", redo, "t7", {"extract_shards": 1})
    assert ledger.counters() == {"extract_shards": 4, "generate_shards": 1}


def test_maxima_keep_the_largest(redis_url):
    ledger = Ledger.from_url(redis_url, "r")
    counters = ShardCounters(ledger)
    counters.record_maxima({"canary_error": 0.5})
    counters.record_maxima({"canary_error": 0.25})
    counters.record_maxima({})
    assert ledger.maxima() == {"canary_error": 0.5}
