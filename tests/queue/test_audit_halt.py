"""An extract worker process that a reference audit halted stops (queue/audit_halt.py): a real `dflash-queue worker
extract` on the tiny model and a real redis-server. Its first stored shard is recorded under its incarnation and
sent to the audit lane; once the audit's verdict halts that incarnation, the worker takes no task (the shard sent
after the halt goes back to the queue, unrun) and exits with status 78, leaving a stop record that says why."""

from __future__ import annotations

import random

import pytest
import redis

from dflash_queue.lanes.registry import AUDIT, EXTRACT
from dflash_queue.queue.app import configure_app
from dflash_queue.queue.liveness import Liveness
from dflash_queue.queue.messages import messages_in
from dflash_queue.queue.tasks import send_to_lane
from dflash_queue.runstate.audits import AuditRecords
from dflash_queue.runstate.ledger import DONE, GENERATED, Ledger
from dflash_queue.runstate.stopped_workers import EXIT_FAILING_CHECKS, StoppedWorkers
from dflash_queue.shards.completions import CompletionRecord, encode_completions
from dflash_queue.shards.keys import completions_key, shard_key
from dflash_queue.shards.suspects import read_mark
from dflash_queue.storage import open_storage
from dfq_testing.polling import wait_for_states, wait_until

pytestmark = pytest.mark.slow


def completions(storage, ledger, shard_id: str) -> None:
    rng = random.Random(shard_id)
    records = [
        CompletionRecord(id=f"{shard_id}-{i}", prompt_ids=[rng.randrange(1000) for _ in range(20)],
                         completion_ids=[rng.randrange(1000) for _ in range(12)], finish_reason="stop",
                         thinking=False, text="")
        for i in range(2)
    ]
    storage.write_bytes(completions_key(shard_id), encode_completions(records))
    ledger.set_state(shard_id, GENERATED, num_samples=2)


def test_a_worker_a_reference_audit_halted_hands_its_task_back_and_exits_78(make_config, redis_url, start_worker):
    config = make_config(audit={"enabled": True}, broker={"worker_liveness_s": 3})
    configure_app(config)
    storage = open_storage(config.storage)
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    ledger = Ledger(client, config.run.name)
    for shard_id in ("first", "second"):
        completions(storage, ledger, shard_id)
    worker = start_worker(config, "extract")
    send_to_lane(EXTRACT.name, "first", 2, config.fingerprint())
    wait_for_states(ledger, ["first"], {DONE}, timeout=120)
    audits = AuditRecords(client, config.run.name)
    stored = audits.stored_shard("first", 0)
    [incarnation] = [i for i in Liveness(client, config.run.name, 3).incarnations().values() if i.node == worker.hostname]
    assert stored is not None and stored.incarnation == incarnation.id and stored.node == worker.hostname
    assert stored.dtype == "float32" and messages_in(client, AUDIT.queue) == 1  # its first shard: sent to the audit

    audits.record_failed(stored, "audit of shard first: layer 1 (decoder_output): worst token 1.0e+00")
    send_to_lane(EXTRACT.name, "second", 2, config.fingerprint())
    assert worker.process.wait(timeout=60) == EXIT_FAILING_CHECKS, worker.log_tail()
    [record] = StoppedWorkers(client, config.run.name).all()
    assert record.node == worker.hostname and record.lane == "extract" and record.exit_status == EXIT_FAILING_CHECKS
    assert record.reason == "halted by the reference audit: audit of shard first: layer 1 (decoder_output): worst " \
                            "token 1.0e+00"
    # The shard sent after the halt was not computed: back on the queue for a healthy worker.
    assert not storage.exists(shard_key("second")) and ledger.states(["second"]) == {"second": GENERATED}
    wait_until(lambda: messages_in(client, EXTRACT.queue) == 1, 30, "the handed-back task on the queue")
    assert audits.is_suspect("first", 0) and read_mark(storage, "first", 0) is None  # the audit lane marks storage
