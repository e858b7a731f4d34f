"""A trainer consuming a run while it extracts: real workers, Redis, the tiny model; storage bounded by the window."""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path

import pytest

from dflash_queue.consumption import Consumption
from dflash_queue.ledger import Ledger
from dflash_queue.live import LiveShards
from dflash_queue.producer import Producer
from dflash_queue.queue.app import configure_app
from dfq_testing.jobs import dataset_ids, first_lines

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "examples" / "sharegpt_sample.jsonl"
pytestmark = pytest.mark.slow

WINDOW = 2


def stored_training_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*.safetensors") if not p.name.startswith(".")]


def live_config(make_config, **overrides):
    return make_config(
        dataset={"shard_size": 4, "thinking": "never"},
        generate__sampling={"max_tokens": 8},
        extract={"max_unconsumed_shards": WINDOW},
        storage={"retention": "until-consumed"},
        **overrides,
    )


def test_two_ranks_train_while_it_extracts_two_epochs_within_the_window(make_config, redis_url, start_worker, tmp_path):
    config = live_config(make_config)
    configure_app(config)
    dataset = first_lines(SAMPLE, 22, tmp_path / "prompts.jsonl")  # 6 shards, the last of 2 samples
    workers = [start_worker(config, "generate"), start_worker(config, "extract")]
    report = Producer(config, Ledger.from_url(redis_url, config.run.name)).enqueue([dataset])
    assert report.enqueued == 6
    storage_root = Path(config.storage.url)

    seen: dict[int, Counter[str]] = {0: Counter(), 1: Counter()}
    shards_per_rank: dict[int, Counter[int]] = {0: Counter(), 1: Counter()}
    fills: list[int] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def train(rank: int) -> None:
        try:
            live = LiveShards(config, consumer="drafter", rank=rank, world_size=2, epochs=2, poll_s=0.2)
            for shard in live:
                with lock:
                    fills.append(len(stored_training_files(storage_root)))
                    seen[shard.epoch].update(shard[i]["sample_id"] for i in range(len(shard)))
                    # Samples the quality gate dropped are accounted for in the shard, never extracted.
                    seen[shard.epoch].update(entry["id"] for entry in shard.shards[0].dropped)
                    shards_per_rank[rank][shard.epoch] += 1
                live.ack(shard)
                with lock:
                    fills.append(len(stored_training_files(storage_root)))
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)

    threads = [threading.Thread(target=train, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert not any(t.is_alive() for t in threads), [w.log_tail() for w in workers]
    assert not errors, errors

    expected = dataset_ids(dataset)
    for epoch in (0, 1):
        assert set(seen[epoch]) == expected and set(seen[epoch].values()) == {1}, epoch
        assert shards_per_rank[0][epoch] == shards_per_rank[1][epoch] == 3
    assert max(fills) <= WINDOW, fills
    # Every shard was consumed by the only consumer and deleted, its samples recorded.
    assert stored_training_files(storage_root) == []
    assert len(list((storage_root / "consumed" / "0").glob("*.json"))) == 6
    assert len(list((storage_root / "consumed" / "1").glob("*.json"))) == 6
    assert len(list((storage_root / "completions").glob("*.jsonl"))) == 6
    consumption = Consumption.from_url(redis_url, config.run.name)
    assert consumption.window_fill() == 0
