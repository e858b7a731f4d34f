"""The live dataset's window of unconsumed shards (runstate/window.py) on a real redis-server: a shard no consumer
will read takes no place."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_queue.deadletters import DeadLetters
from dflash_queue.deadletters.requeue import requeue
from dflash_queue.live import LiveShards
from dflash_queue.producer import Producer
from dflash_queue.queue.steps.dead_letters import DeadLettering
from dflash_queue.runstate.ledger import DONE, Ledger
from dflash_queue.runstate.window import ShardWindow
from dflash_queue.shards.keys import prompts_key
from dflash_queue.shards.prompts import decode_prompts
from dflash_queue.storage import open_storage
from tests.test_verify import store_shard

SAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sharegpt_sample.jsonl"


@pytest.mark.parametrize("after", ["the consumer finished", "the consumer reads the next epoch"])
def test_a_failed_shard_requeued_after_its_epoch_ended_holds_no_place(make_config, redis_url, tmp_path, after):
    """A shard that failed for good is left out of its epoch; requeued once every consumer left that epoch, it is
    extracted and stored again, but no consumer reads it there: it must not hold a place, nor keep the run up."""
    config = make_config(dataset={"shard_size": 4, "thinking": "never"}, extract={"max_unconsumed_shards": 2})
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("\n".join(SAMPLE.read_text().splitlines()[:8]) + "\n")
    ledger = Ledger.from_url(redis_url, config.run.name)
    good, bad = Producer(config, ledger).enqueue([dataset], send=lambda *args: None).shard_ids
    storage = open_storage(config.storage)
    window = ShardWindow(ledger.client, config.run.name)
    dead_letters = DeadLetters.from_url(redis_url, config.run.name)
    epochs = 1 if after == "the consumer finished" else 2
    trainer = LiveShards(config, consumer="trainer", epochs=epochs, poll_s=0.05)

    def extracted(shard_id: str) -> None:
        """What the extract lane does for a shard: a place, the file stored, its position, done."""
        assert window.take_place(0, shard_id, 2)
        ids = [p.id for p in decode_prompts(storage.read_bytes(prompts_key(shard_id)), what=shard_id)]
        store_shard(storage, shard_id, ids)
        window.record_stored(0, shard_id)
        ledger.set_state(shard_id, DONE)

    extracted(good)
    assert window.take_place(0, bad, 2) and window.window_fill() == 2
    args = (bad, 4, config.fingerprint())
    DeadLettering(dead_letters, ledger, window).task_failed(
        "dfq.extract", args, {}, RuntimeError("engine lost"), deliveries=3, worker="extract-0@box"
    )
    assert window.window_fill() == 1  # a shard that will not be stored gives its place back

    served = []
    for shard in trainer.epoch(0):
        served.append(shard.shard_id)
        trainer.ack(shard)
    assert served == [good] and trainer.failed == {0: [bad]} and window.window_fill() == 0
    if epochs == 2:
        assert next(trainer.epoch(1, idle=True)) is None  # in epoch 1, waiting for its first shard
    else:
        assert window.to_go(ledger) == {}

    sent: list[tuple] = []
    [outcome] = requeue(config.run, config.fingerprint(), dead_letters, ledger, dead_letters.all(),
                        lambda *message: sent.append(message))
    assert outcome.action == "sent" and [m[1] for m in sent] == [args]
    extracted(bad)
    assert window.places() == [], "a shard stored after every consumer left its epoch holds a place"
    assert "epoch 0" not in window.to_go(ledger).get("trainer", ""), window.to_go(ledger)
