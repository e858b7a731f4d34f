"""The reference audit's bookkeeping (runstate/audits.py) on a real redis-server: which shards are sent to the audit,
what a failed audit makes suspect (every shard its worker stored after its last passed audit before the failing one,
and after it), a halted worker's later shards suspect at once, other workers untouched."""

from __future__ import annotations

import redis

from dflash_queue.runstate.audits import AuditRecords


def records(redis_url: str) -> AuditRecords:
    return AuditRecords(redis.Redis.from_url(redis_url, decode_responses=True), "r")


def store(audits: AuditRecords, shards, incarnation="inc-a", *, every_shards=3, every_s=0.0, now=100.0):
    return [audits.record_stored(s, 0, incarnation, "extract@a", every_shards=every_shards, every_s=every_s, now=now)
            for s in shards]


def test_a_workers_first_shard_is_audited_then_one_in_every_n_and_one_every_interval(redis_url):
    audits = records(redis_url)
    verdicts = store(audits, [f"s{i}" for i in range(7)])
    assert [v.audit_due for v in verdicts] == [True, False, False, True, False, False, True]
    assert [v.position for v in verdicts] == list(range(1, 8)) and not any(v.halted for v in verdicts)
    other = store(audits, ["t0", "t1"], incarnation="inc-b")  # another worker process: its own count
    assert [v.audit_due for v in other] == [True, False] and other[0].position == 8
    # By time: a shard stored `every_s` after the last audit was sent is due whatever the count.
    assert store(audits, ["s7"], every_shards=100, every_s=60.0, now=130.0)[0].audit_due is False
    assert store(audits, ["s8"], every_shards=100, every_s=60.0, now=170.0)[0].audit_due is True
    stored = audits.stored_shard("s3", 0)
    assert stored is not None and (stored.incarnation, stored.node, stored.position) == ("inc-a", "extract@a", 4)


def test_a_failed_audit_halts_its_worker_and_makes_its_unchecked_shards_suspect(redis_url):
    audits = records(redis_url)
    store(audits, [f"s{i}" for i in range(10)])
    store(audits, ["t0", "t1"], incarnation="inc-b")
    for passed in ("s0", "s3", "s8"):  # s8's audit passes, later than s6's fails: s6 and what follows are suspect
        audits.record_passed(audits.stored_shard(passed, 0), "ok")
    failing = audits.stored_shard("s6", 0)
    made = audits.record_failed(failing, "layer 14: worst token 1.3e+00", now=200.0)
    assert [s.shard for s in made] == ["s4", "s5", "s6", "s7", "s8", "s9"]
    assert all(s.audited == "s6" and s.incarnation == "inc-a" and s.reason.startswith("layer 14") for s in made)
    assert audits.halted("inc-a").startswith("layer 14") and audits.halted("inc-b") == ""
    assert [s.shard for s in audits.suspects()] == ["s4", "s5", "s6", "s7", "s8", "s9"]
    assert audits.stored_shard("s6", 0).verdict == "failed" and audits.stored_shard("s8", 0).verdict == "passed"
    # A shard the halted worker stores afterwards (a task in flight) is suspect at once; the other worker's are not.
    [late] = store(audits, ["s10"], now=210.0)
    assert late.halted.startswith("layer 14") and not late.audit_due and audits.is_suspect("s10", 0)
    assert not store(audits, ["t2"], incarnation="inc-b")[0].halted and not audits.is_suspect("t2", 0)
    # A second failure adds only what was not suspect yet; a consumer noted; a shard stored anew is cleared.
    assert audits.record_failed(audits.stored_shard("s9", 0), "again") == []
    noted = audits.note_consumed(made[0], ["trainer"])
    assert noted.consumed_by == ["trainer"] and audits.suspects()[0].consumed_by == ["trainer"]
    assert audits.clear_suspect("s4", 0) and not audits.is_suspect("s4", 0) and not audits.clear_suspect("s4", 0)


def test_a_worker_with_no_passed_audit_leaves_everything_it_stored_suspect(redis_url):
    audits = records(redis_url)
    store(audits, ["s0", "s1", "s2"])
    made = audits.record_failed(audits.stored_shard("s0", 0), "first shard wrong")
    assert [s.shard for s in made] == ["s0", "s1", "s2"]
