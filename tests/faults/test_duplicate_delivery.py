"""The same task delivered to two workers at once: one shard, written whole, counted once."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_queue.lanes.registry import GENERATE
from dflash_queue.producer import Producer
from dflash_queue.queue.app import configure_app
from dflash_queue.queue.tasks import LANE_TASKS
from dflash_queue.runstate.ledger import DONE, Ledger
from dfq_testing.jobs import assert_accounted
from dfq_testing.pipeline_shards import FLAG_EVERYTHING
from dfq_testing.polling import wait_for_states

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_duplicate_delivery_to_two_workers_writes_each_shard_once(make_config, redis_url, start_worker, tmp_path):
    config = make_config(dataset={"shard_size": 4, "thinking": "never"}, quality=FLAG_EVERYTHING,
                         **{"generate.sampling": {"max_tokens": 12}})
    configure_app(config)
    lines = (REPO / "examples" / "sharegpt_sample.jsonl").read_text().splitlines()[:12]
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("\n".join(lines) + "\n")
    workers = [start_worker(config, lane) for lane in ("generate", "generate", "extract", "extract")]

    def send_twice(shard_id: str, num_samples: int, fingerprint: str) -> None:
        # Back to back on one queue: each of the two idle generate workers takes one copy at the same time.
        for _ in range(2):
            LANE_TASKS["generate"].apply_async(args=(shard_id, num_samples, fingerprint), queue=GENERATE.queue)

    ledger = Ledger.from_url(redis_url, config.run.name)
    report = Producer(config, ledger).enqueue([dataset], send=send_twice)
    wait_for_states(ledger, report.shard_ids, {DONE}, timeout=300, workers=workers)
    # Both copies ran (each chained its extraction): wait until every one of the 12 tasks has finished.
    for worker in workers:
        worker.stop()
    logs = "".join(w.log_path.read_text() for w in workers)
    assert logs.count("succeeded in") == 12, logs[-3000:]

    assert_accounted(config, dataset, done=12)
    counters = ledger.counters()
    assert (counters["generate_shards"], counters["extract_shards"]) == (3, 3)
    assert counters["generate_samples"] == counters["extract_samples"] == 12
    storage_root = Path(config.storage.url)
    assert sorted(p.name for p in (storage_root / "shards").iterdir()) == sorted(f"{s}.safetensors" for s in report.shard_ids)
    assert not [p for p in storage_root.rglob("*") if p.is_file() and ".tmp" in p.name]
