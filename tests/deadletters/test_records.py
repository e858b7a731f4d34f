"""Dead letters on a real redis-server: one record per failed unit, filters, and requeue-once semantics."""

from __future__ import annotations

import threading
from dataclasses import replace

import redis

from dflash_queue.deadletters import MESSAGE, SAMPLE, TASK, DeadLetter, DeadLetters, Filter, exception_fields, record_id


def record(kind=TASK, lane="extract", shard="s1", samples=(), exc=None) -> DeadLetter:
    exc = exc if exc is not None else ValueError("bad")
    return DeadLetter(
        id=record_id(kind, lane, shard, samples, task_id="t1"),
        kind=kind,
        lane=lane,
        task=f"dfq.{lane}",
        shard_id=shard,
        args=[shard, 8, "fp"],
        sample_ids=list(samples),
        **exception_fields(exc),
    )


def store(redis_url: str) -> DeadLetters:
    return DeadLetters(redis.Redis.from_url(redis_url, decode_responses=True), "test")


def test_a_unit_failing_again_updates_its_record(redis_url):
    dead = store(redis_url)
    first = dead.add(record(), now=100.0)
    again = dead.add(record(exc=RuntimeError("worse")), now=160.0)
    assert dead.count() == 1
    assert (again.first_failed, again.last_failed, again.failures) == (100.0, 160.0, 2)
    stored = dead.get(first.id)
    assert stored == again and stored.exc_type == "RuntimeError" and "worse" in stored.traceback


def test_records_keep_what_an_operator_needs(redis_url):
    dead = store(redis_url)
    try:
        raise KeyError("input_ids")
    except KeyError as exc:
        added = dead.add(record(kind=SAMPLE, samples=["abc"], exc=exc))
    shown = dead.get(added.id)
    assert shown.kind == SAMPLE and shown.sample_ids == ["abc"] and shown.shard_id == "s1"
    assert shown.exc_type == "KeyError" and "raise KeyError" in shown.traceback
    assert shown.requeueable and not record(kind=MESSAGE).requeueable


def test_records_keep_any_text_and_argument_exactly(redis_url):
    dead = store(redis_url)
    cases = [
        ("s1", "«naïve» 数据, \u2028", ["s1", 1e-05, float("inf")]),
        ("s2", "undecodable \udcff byte", ["s2"]),
        ("s3", "big", ["s3", 2**70 + 1]),
    ]
    for shard, message, args in cases:
        added = dead.add(replace(record(shard=shard, exc=ValueError(message)), args=args, kwargs={"k": None}))
        shown = dead.get(added.id)
        assert shown.message == message and shown.args == args and shown.kwargs == {"k": None}
        assert DeadLetter.from_json(shown.to_json().encode()) == shown


def test_filters_by_lane_type_kind_and_age(redis_url):
    dead = store(redis_url)
    dead.add(record(lane="generate", shard="g1"), now=1000.0)
    dead.add(record(lane="extract", shard="e1", exc=TimeoutError()), now=1900.0)
    dead.add(record(kind=SAMPLE, lane="extract", shard="e2", samples=["x"]), now=1990.0)
    now = 2000.0

    def ids(**kw):
        return sorted(r.shard_id for r in dead.select(Filter(**kw), now=now))

    assert ids(lane="extract") == ["e1", "e2"]
    assert ids(exc_type="TimeoutError") == ["e1"]
    assert ids(kind="sample") == ["e2"]
    assert ids(older_than_s=500) == ["g1"]
    assert ids(newer_than_s=60) == ["e2"]
    assert [r.shard_id for r in dead.select(ids=[record_id(TASK, "generate", "g1")], now=now)] == ["g1"]


def test_two_operators_requeueing_one_record_get_it_once(redis_url):
    dead = store(redis_url)
    target = dead.add(record())
    winners = []
    barrier = threading.Barrier(8)

    def operator():
        mine = store(redis_url)
        barrier.wait()
        if mine.take(target.id) is not None:
            winners.append(1)

    threads = [threading.Thread(target=operator) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(winners) == 1 and dead.count() == 0
    dead.put_back(target)
    assert dead.get(target.id) == target
    assert dead.remove([target.id, "no-such"]) == 1


def test_a_shard_that_succeeds_later_settles_its_task_record(redis_url):
    dead = store(redis_url)
    dead.add(record(kind=TASK, lane="generate", shard="s1"))
    dead.add(record(kind=SAMPLE, lane="generate", shard="s1", samples=["x"]))
    assert dead.settle("generate", "s1") and not dead.settle("extract", "s1")
    assert [r.kind for r in dead.all()] == [SAMPLE]  # a poison sample stays until requeued: it is not in the shard
