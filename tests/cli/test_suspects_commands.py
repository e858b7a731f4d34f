"""`dflash-queue suspects list|reextract` on a real redis-server: what an operator reads, and the messages sent."""

from __future__ import annotations

import base64
import json

import redis
from click.testing import CliRunner

from dflash_queue.cli import main
from dflash_queue.lanes.registry import EXTRACT
from dflash_queue.runstate.audits import AuditRecords
from dflash_queue.runstate.ledger import DONE, GENERATED, Ledger
from dflash_queue.shards.completions import CompletionRecord, encode_completions
from dflash_queue.shards.keys import completions_key
from dflash_queue.shards.suspects import SuspectMark, mark_suspect
from dflash_queue.storage import open_storage


def queued(client: redis.Redis, queue: str) -> list[tuple[list, dict]]:
    """(args, kwargs) of each task message waiting in a queue, as kombu keeps it."""
    found = []
    for raw in client.lrange(queue, 0, -1):
        payload = json.loads(raw)
        args, kwargs, _ = json.loads(base64.b64decode(payload["body"]))
        found.append((args, kwargs))
    return found


def test_list_names_each_suspect_and_reextract_sends_it_with_redo(make_config, redis_url):
    config = make_config()
    ledger = Ledger.from_url(redis_url, config.run.name)
    storage = open_storage(config.storage)
    audits = AuditRecords(ledger.client, config.run.name)
    for shard in ("s1", "s2"):
        ledger.set_state(shard, DONE, num_samples=2)
        audits.record_stored(shard, 0, "inc-a", "extract@node-a", every_shards=9, every_s=0.0)
    [first, second] = audits.record_failed(audits.stored_shard("s1", 0), "layer 2: worst token 1.3e+00")
    audits.note_consumed(first, ["drafter"])
    for suspect in (first, second):
        mark_suspect(storage, SuspectMark(suspect.shard, 0, suspect.reason, "s1", "extract@node-a"))
    records = [CompletionRecord(f"s1-{i}", [1, 2], [3], "stop", False, "x") for i in range(2)]
    storage.write_bytes(completions_key("s1"), encode_completions(records))  # s2's are gone

    run = CliRunner().invoke
    listed = run(main, ["suspects", "list", "-c", config.source])
    assert listed.exit_code == 0, listed.output
    assert "s1: stored by extract@node-a; the audit of shard s1 failed: layer 2: worst token 1.3e+00; consumed " \
        "before it turned suspect by drafter" in listed.output
    assert listed.output.splitlines()[-1] == "2 suspect shard(s), 1 consumed before they turned suspect"
    as_json = json.loads(run(main, ["suspects", "list", "-c", config.source, "--json"]).output)
    assert sorted((s["shard"], s["epoch"], s["node"], s["consumed_by"]) for s in as_json) == [
        ("s1", 0, "extract@node-a", ["drafter"]), ("s2", 0, "extract@node-a", [])]

    client = redis.Redis.from_url(redis_url)
    sent = run(main, ["suspects", "reextract", "-c", config.source])
    assert sent.exit_code == 1, sent.output  # s2 is refused, named
    assert "sent: s1: dfq.extract on queue extract, redo, 2 samples (was done)" in sent.output
    assert "refused: s2: its completions (completions/s2.jsonl) are not in" in sent.output
    assert queued(client, EXTRACT.queue) == [(["s1", 2, config.fingerprint()], {"redo": True})]
    assert ledger.states(["s1", "s2"]) == {"s1": GENERATED, "s2": DONE}  # pending for status and verify
    assert storage.exists("suspect/0/s1.json")  # until the new shard is stored
    again = run(main, ["suspects", "reextract", "-c", config.source, "--json"])
    outcomes = {o["shard"]: o["action"] for o in json.loads(again.output)}
    assert outcomes == {"s1": "already sent", "s2": "refused"} and len(queued(client, EXTRACT.queue)) == 1
