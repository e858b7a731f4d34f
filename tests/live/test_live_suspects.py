"""Live training and suspect shards, with real ranks (LiveShards in threads), a real redis-server and local storage;
the extract lane's part (storing a shard, its place, its store position, clearing the marks) done by hand as the
lane does it. No rank reads a suspect shard; its place goes back to the window; once it is stored anew the rank
whose shard it is serves it, and the epoch ends only then."""

from __future__ import annotations

import threading
from pathlib import Path

from dflash_queue.live import LiveShards
from dflash_queue.producer import Producer
from dflash_queue.runstate.audits import AuditRecords
from dflash_queue.runstate.ledger import DONE, Ledger
from dflash_queue.runstate.window import TAKEN, ShardWindow
from dflash_queue.shards.keys import prompts_key
from dflash_queue.shards.prompts import decode_prompts
from dflash_queue.shards.suspects import SuspectMark, clear_mark, mark_suspect
from dflash_queue.storage import open_storage
from dfq_testing.polling import wait_until
from tests.test_verify import store_shard

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "examples" / "sharegpt_sample.jsonl"
WINDOW = 5


def test_ranks_never_read_a_suspect_shard_give_its_place_back_and_serve_it_once_stored_anew(
    make_config, redis_url, tmp_path
):
    config = make_config(dataset={"shard_size": 2, "thinking": "never"}, extract={"max_unconsumed_shards": WINDOW})
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("\n".join(SAMPLE.read_text().splitlines()[:10]) + "\n")
    ledger = Ledger.from_url(redis_url, config.run.name)
    report = Producer(config, ledger).enqueue([dataset], send=lambda *args: None)
    storage = open_storage(config.storage)
    window = ShardWindow(ledger.client, config.run.name)
    audits = AuditRecords(ledger.client, config.run.name)
    ids = {s: [p.id for p in decode_prompts(storage.read_bytes(prompts_key(s)), what=s)] for s in report.shard_ids}
    order = sorted(report.shard_ids)  # stored in this order: positions 0..4, rank n % 2

    def store(shard_id: str) -> int:
        """What the extract lane does: a place, the file, the store position, the state."""
        taken = window.take_place(0, shard_id, WINDOW)
        store_shard(storage, shard_id, ids[shard_id])
        window.record_stored(0, shard_id)
        ledger.set_state(shard_id, DONE)
        return taken

    for shard_id in order:
        assert store(shard_id) == TAKEN
    a, b, c, d, e = order
    # A second consumer reads c and e; the trainer had read e too: e was consumed by everyone, its place given back.
    reader = LiveShards(config, consumer="reader", poll_s=0.1)
    trainer_before = LiveShards(config, consumer="trainer", rank=0, world_size=2, poll_s=0.1)
    for shard_id in (c, e):
        reader.acknowledge(0, shard_id)
    trainer_before.acknowledge(0, e)
    assert window.places_held(0, [e]) == set()

    # The audit of c fails: c, d and e were stored by the same worker since its last passed audit (of b).
    for shard_id in order:
        audits.record_stored(shard_id, 0, "inc-a", "extract@node-a", every_shards=100, every_s=0.0)
    audits.record_passed(audits.stored_shard(b, 0), "ok")
    made = audits.record_failed(audits.stored_shard(c, 0), "layer 2: worst token 1.3e+00")
    assert [s.shard for s in made] == [c, d, e]
    for suspect, consumers in zip(made, (["reader"], [], ["reader", "trainer"]), strict=True):
        audits.note_consumed(suspect, consumers)  # as the audit lane does, from the acknowledgements
        if suspect.shard != c:  # c: the broker's record only (its mark not written yet)
            mark_suspect(storage, SuspectMark(suspect.shard, 0, suspect.reason, c, "extract@node-a"))
    audits.clear_suspect(d, 0)  # d: marked in storage only (the storage mark is the readers' own check)

    served: dict[int, list[str]] = {0: [], 1: []}
    ranks = [LiveShards(config, consumer="trainer", rank=rank, world_size=2, poll_s=0.1) for rank in (0, 1)]
    errors: list[BaseException] = []

    def train(rank: int) -> None:
        try:
            for shard in ranks[rank].epoch(0):
                assert len(shard) == 2
                served[rank].append(shard.shard_id)
                ranks[rank].ack(shard)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=train, args=(rank,), daemon=True) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    # The good ones are served; the suspect ones wait, and their places went back to the window.
    wait_until(lambda: sorted(served[0] + served[1]) == sorted([a, b]) and ranks[0].suspect.get(0, {}).keys() == {c}
               and ranks[1].suspect.get(0, {}).keys() == {d}, 30, "the good shards served, the suspect ones waiting")
    assert "layer 2: worst token 1.3e+00" in ranks[0].suspect[0][c] and ranks[1].suspect[0][d]
    assert window.places_held(0, [c, d, e]) == set() and all(t.is_alive() for t in threads)
    assert not errors, errors

    # Extracted again (`dflash-queue suspects reextract`): each takes a place anew, except e, which every consumer
    # had acknowledged (no one would give its place back); stored, the marks cleared as the extract lane does.
    for shard_id in (c, d, e):
        assert store(shard_id) == TAKEN
    assert window.places_held(0, [c, d, e]) == {c, d}
    for shard_id in (c, d, e):
        audits.clear_suspect(shard_id, 0)
        clear_mark(storage, shard_id, 0)
    for thread in threads:
        thread.join(timeout=30)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    # Each shard served once, by the rank of its first store position; e (read by everyone before) not again.
    assert served == {0: [a, c], 1: [b, d]}
    # Places go back once every consumer has a shard: c (the reader had it) and e; not a, b, d, which it has not.
    assert window.places_held(0, order) == {a, b, d}
    reader.acknowledge(0, d)
    assert window.places_held(0, order) == {a, b}
    # A consumer that acknowledges a shard after it turned suspect was served it as good: it is named.
    audits.record_stored(a, 0, "inc-b", "extract@node-b", every_shards=100, every_s=0.0)
    audits.record_failed(audits.stored_shard(a, 0), "late")
    reader.acknowledge(0, a)
    assert {s.shard: s.consumed_by for s in audits.suspects()} == {a: ["reader"]}


def test_a_suspect_shard_whose_extraction_again_fails_for_good_is_left_out_and_the_epoch_ends(
    make_config, redis_url, tmp_path
):
    config = make_config(dataset={"shard_size": 2, "thinking": "never"})
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("\n".join(SAMPLE.read_text().splitlines()[:4]) + "\n")
    ledger = Ledger.from_url(redis_url, config.run.name)
    report = Producer(config, ledger).enqueue([dataset], send=lambda *args: None)
    storage = open_storage(config.storage)
    window = ShardWindow(ledger.client, config.run.name)
    good, bad = sorted(report.shard_ids)
    for shard_id in (good, bad):
        store_shard(storage, shard_id, [p.id for p in decode_prompts(storage.read_bytes(prompts_key(shard_id)),
                                                                     what=shard_id)])
        window.record_stored(0, shard_id)
        ledger.set_state(shard_id, DONE)
    mark_suspect(storage, SuspectMark(bad, 0, "wrong states", bad, "extract@node-a"))
    live = LiveShards(config, consumer="trainer", poll_s=0.1)
    ledger.mark_failed(bad, "dfq.extract: RuntimeError: the redo failed")  # its re-extraction, dead-lettered
    served: list[str] = []
    rank = threading.Thread(target=lambda: served.extend(shard.shard_id for shard in live.epoch(0)), daemon=True)
    rank.start()
    rank.join(timeout=30)
    assert not rank.is_alive(), "the rank still waits for a shard whose extraction failed for good"
    assert served == [good] and live.failed == {0: [bad]} and live.suspect == {0: {}}
