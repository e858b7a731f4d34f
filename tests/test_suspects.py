"""Suspect shards as an operator sees them, and their re-extraction (dflash_queue/suspects.py), on a real redis-server
and local storage."""

from __future__ import annotations

import pytest

from dflash_queue.runstate.audits import AuditRecords
from dflash_queue.runstate.ledger import DONE, GENERATED, Ledger
from dflash_queue.runstate.window import ShardWindow
from dflash_queue.shards.completions import CompletionRecord, encode_completions
from dflash_queue.shards.keys import completions_key
from dflash_queue.shards.suspects import SuspectMark, mark_suspect
from dflash_queue.shards.verdicts import DROP, Verdict
from dflash_queue.storage import LocalStorage
from dflash_queue.suspects import ALREADY_SENT, REFUSED, SENT, WOULD_SEND, find_suspects, reextract


def completions(storage, shard_id: str, kept: int, dropped: int = 0) -> None:
    records = [
        CompletionRecord(f"{shard_id}-{i}", [1, 2], [3], "stop", False, "x", quality=None if i < kept else Verdict(DROP))
        for i in range(kept + dropped)
    ]
    storage.write_bytes(completions_key(shard_id), encode_completions(records))


def test_suspects_come_from_the_broker_and_the_marks_each_saying_what_the_other_lacks(redis_url, tmp_path):
    ledger = Ledger.from_url(redis_url, "r")
    audits = AuditRecords(ledger.client, "r")
    storage = LocalStorage(tmp_path)
    for shard in ("a", "b"):
        audits.record_stored(shard, 0, "inc-a", "extract@x", every_shards=9, every_s=0.0, now=10.0)
    audits.record_stored("c", 2, "inc-a", "extract@x", every_shards=9, every_s=0.0, now=11.0)
    made = audits.record_failed(audits.stored_shard("a", 0), "layer 1 off", now=20.0)
    audits.note_consumed(made[0], ["trainer"])
    for suspect in made[:2]:  # c (epoch 2) has no mark yet; d is marked in storage only
        mark_suspect(storage, SuspectMark(suspect.shard, suspect.epoch, suspect.reason, "a", "extract@x", 20.0))
    mark_suspect(storage, SuspectMark("d", 0, "its worker was halted", "", "extract@y", 30.0))

    found = {(s.epoch, s.shard): s for s in find_suspects(audits, storage)}
    assert sorted(found) == [(0, "a"), (0, "b"), (0, "d"), (2, "c")]
    assert found[(0, "a")].consumed_by == ("trainer",) and found[(0, "a")].marked and found[(0, "a")].in_broker
    assert "no mark in storage" in found[(2, "c")].describe() and found[(2, "c")].name == "c (epoch 2)"
    assert not found[(0, "d")].in_broker and "marked in storage only" in found[(0, "d")].describe()
    assert [s.shard for s in find_suspects(audits, storage, epoch=2)] == ["c"]
    assert [s.marked for s in find_suspects(audits)] == [None, None, None]  # storage not looked at


def test_reextract_sends_each_with_redo_in_its_epoch_sets_it_pending_and_refuses_what_cannot_be_redone(
    redis_url, tmp_path
):
    ledger = Ledger.from_url(redis_url, "r")
    window = ShardWindow(ledger.client, "r")
    audits = AuditRecords(ledger.client, "r")
    storage = LocalStorage(tmp_path)
    for shard, epoch in (("a", 0), ("b", 0), ("c", 1)):
        audits.record_stored(shard, epoch, "inc-a", "extract@x", every_shards=9, every_s=0.0)
    ledger.set_state("a", DONE, num_samples=4)
    ledger.set_state("b", DONE, num_samples=4)
    window.set_epoch_state(1, "c", DONE)
    audits.record_failed(audits.stored_shard("a", 0), "bad")
    completions(storage, "a", kept=3, dropped=1)
    completions(storage, "c", kept=2)  # b's completions are gone
    sent: list[tuple[str, int, str, int]] = []

    def run(**options):
        return reextract("r", "fp-1", find_suspects(audits, storage), ledger=ledger, storage=storage,
                         send=lambda *message: sent.append(message), **options)

    dry = run(dry_run=True)
    assert [o.action for o in dry.outcomes] == [WOULD_SEND, REFUSED, WOULD_SEND] and not sent
    assert ledger.states(["a"]) == {"a": DONE}
    report = run()
    assert sent == [("a", 3, "fp-1", 0), ("c", 2, "fp-1", 1)]  # kept samples only; each in its epoch
    assert [(o.shard, o.action) for o in report.outcomes] == [("a", SENT), ("b", REFUSED), ("c", SENT)]
    assert "completions/b.jsonl) are not in" in report.refused[0].detail
    assert "dfq.extract on queue extract, redo, 3 samples (was done)" in report.outcomes[0].line()
    assert report.lines()[-1] == "2 sent, 1 refused"
    assert ledger.states(["a", "b"]) == {"a": GENERATED, "b": DONE} and window.epoch_states(1) == {"c": GENERATED}
    # Sent already and not stored yet: not sent twice, unless asked.
    again = run()
    assert [o.action for o in again.outcomes] == [ALREADY_SENT, REFUSED, ALREADY_SENT] and len(sent) == 2
    run(resend=True)
    assert len(sent) == 4

    # A send that fails leaves the state as it was.
    ledger.set_state("a", DONE)

    def broken(*message):
        raise ConnectionError("broker gone")

    with pytest.raises(ConnectionError):
        reextract("r", "fp-1", find_suspects(audits, storage, epoch=0), ledger=ledger, storage=storage, send=broken)
    assert ledger.states(["a"]) == {"a": DONE}
