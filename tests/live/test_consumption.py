"""The live dataset's parts without workers: the window, store order, consumers, retention, epochs, verify."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash_queue.cli import main
from dflash_queue.live import LiveShards
from dflash_queue.live.epochs import epoch_order, start_epoch
from dflash_queue.producer import Producer
from dflash_queue.runstate.ledger import DONE, FAILED, Ledger
from dflash_queue.runstate.window import ShardWindow
from dflash_queue.shards.keys import consumed_key, epoch_shard_key, prompts_key, stored_shard_ids
from dflash_queue.shards.locate import locate_shards
from dflash_queue.shards.prompts import decode_prompts
from dflash_queue.storage import open_storage
from dflash_queue.verify import verify
from tests.test_verify import store_shard

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "examples" / "sharegpt_sample.jsonl"


@pytest.fixture
def consumption(redis_url) -> ShardWindow:
    return ShardWindow.from_url(redis_url, "test")


def test_the_window_admits_a_shard_once_and_no_more_than_its_size_at_once(consumption):
    assert consumption.take_place(0, "a", 2) and consumption.take_place(0, "b", 2)
    assert not consumption.take_place(0, "c", 2)
    assert consumption.take_place(0, "a", 2)  # a re-delivery keeps the place it holds
    assert not consumption.take_place(1, "a", 2)  # another epoch's copy is another shard
    consumption.give_back_place(0, "b")
    assert consumption.take_place(0, "c", 2) and consumption.window_fill() == 2

    # Many takers at once never overfill it.
    consumption.give_back_place(0, "a")
    consumption.give_back_place(0, "c")
    taken: list[str] = []

    def take(name: str) -> None:
        if consumption.take_place(0, name, 3):
            taken.append(name)

    threads = [threading.Thread(target=take, args=(f"s{i}",)) for i in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(taken) == 3 and consumption.window_fill() == 3


def test_a_shard_keeps_its_first_position_in_the_store_order(consumption):
    assert [consumption.record_stored(0, s) for s in ("x", "y", "x", "z")] == [0, 1, 0, 2]
    assert consumption.stored_since(0, 1) == [("y", 1), ("z", 2)]
    assert consumption.record_stored(1, "z") == 0  # each epoch has its own order


def test_a_consumer_name_keeps_its_split_and_every_consumer_must_acknowledge(consumption):
    consumption.register("a", world_size=2, seed=0)
    consumption.register("a", world_size=2, seed=0)
    with pytest.raises(ValueError, match="world_size 2 \\(now 4\\)"):
        consumption.register("a", world_size=4, seed=0)
    consumption.register("b", world_size=1, seed=0)
    assert not consumption.acknowledge("a", 0, "s1")
    assert consumption.acknowledge("b", 0, "s1")
    assert not consumption.acknowledge("b", 1, "s1")  # per epoch


def test_live_shards_refuse_a_window_smaller_than_the_ranks(make_config):
    config = make_config(extract={"max_unconsumed_shards": 2})
    with pytest.raises(ValueError, match="below the world size"):
        LiveShards(config, rank=0, world_size=4)


def test_acknowledged_by_every_consumer_a_shard_is_deleted_recorded_and_still_counted_done(make_config, redis_url, tmp_path):
    config = make_config(dataset={"shard_size": 4, "thinking": "never"}, storage={"retention": "until-consumed"},
                         extract={"max_unconsumed_shards": 4})
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("\n".join(SAMPLE.read_text().splitlines()[:8]) + "\n")
    ledger = Ledger.from_url(redis_url, config.run.name)
    report = Producer(config, ledger).enqueue([dataset], send=lambda *args: None)
    storage = open_storage(config.storage)
    first, second = report.shard_ids
    ids = {s: [p.id for p in decode_prompts(storage.read_bytes(prompts_key(s)), what=s)] for s in (first, second)}
    consumption = ShardWindow(ledger.client, config.run.name)
    for shard_id in (first, second):
        assert consumption.take_place(0, shard_id, 4)
        store_shard(storage, shard_id, ids[shard_id][:3], dropped=ids[shard_id][3:])
        consumption.record_stored(0, shard_id)
        ledger.set_state(shard_id, DONE)

    trainer = LiveShards(config, consumer="trainer")
    auditor = LiveShards(config, consumer="auditor")
    served = [shard.shard_id for shard in trainer.epoch(0)]
    assert sorted(served) == sorted((first, second))
    trainer.acknowledge(0, first)
    assert storage.exists(epoch_shard_key(first, 0))  # the auditor registered and has not taken it
    auditor.acknowledge(0, first)
    assert not storage.exists(epoch_shard_key(first, 0)) and storage.exists(consumed_key(first, 0))
    assert consumption.window_fill() == 1
    # Done for the producer (not staged again), for verify (by the record), for a ShardDataset (not listed).
    assert stored_shard_ids(storage) == {first, second}
    result = verify(config, [dataset])
    assert result.ok and result.done == 6 and result.consumed == 3 and result.dropped == 2, result.lines()
    assert locate_shards(storage).keys == (epoch_shard_key(second, 0),)
    # A restarted consumer serves only what it has not acknowledged.
    assert [shard.shard_id for shard in LiveShards(config, consumer="trainer").epoch(0)] == [second]


def test_an_epoch_starts_once_the_previous_extraction_is_over_in_its_own_order(make_config, redis_url, tmp_path):
    config = make_config(dataset={"shard_size": 2, "thinking": "never"})
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("\n".join(SAMPLE.read_text().splitlines()[:12]) + "\n")
    ledger = Ledger.from_url(redis_url, config.run.name)
    report = Producer(config, ledger).enqueue([dataset], send=lambda *args: None)
    consumption = ShardWindow(ledger.client, config.run.name)
    sent: list[tuple[str, int, int]] = []

    def send(shard_id: str, samples: int, fingerprint: str, epoch: int) -> None:
        assert fingerprint == config.fingerprint()
        sent.append((shard_id, samples, epoch))

    start = start_epoch(config, 1, seed=3, consumption=consumption, ledger=ledger, send=send)
    assert not start.started and "6 shards are not extracted yet" in start.why_not and not sent
    *done, failed = report.shard_ids
    for shard_id in done:
        ledger.set_state(shard_id, DONE)
    ledger.mark_failed(failed, "boom")
    start = start_epoch(config, 1, seed=3, consumption=consumption, ledger=ledger, send=send)
    assert start.started and start.left_out == [failed]
    assert [s for s, _, _ in sent] == epoch_order(done, 3, 1) != sorted(done)
    assert {(n, e) for _, n, e in sent} == {(2, 1)}
    assert consumption.epoch_shards(1) == dict.fromkeys(done, 2)
    # Once only; the command says so, and that epoch 3 cannot start before 2.
    assert not start_epoch(config, 1, consumption=consumption, ledger=ledger, send=send).started
    result = CliRunner().invoke(main, ["epoch", "-c", config.source, "--epoch", "3"])
    assert result.exit_code == 1 and "epoch 2 has not started" in result.output
    assert consumption.epoch_states(1) == dict.fromkeys(done, "generated")
    assert FAILED not in consumption.epoch_states(1).values()
