"""Local storage made read-only mid-job: writes fail with StorageUnavailable, tasks retry with backoff, and once
the directory is writable again the job finishes exactly once. Real redis, real workers, the tiny model.

Workers run under `root_bypass_dropped()`: root ignores directory permissions, so as root the workers are
started without the capabilities that would let them write into a 0o555 directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_queue.faults import ENV
from dflash_queue.producer import Producer
from dflash_queue.runstate.ledger import DONE, Ledger
from dfq_testing.jobs import exactly_once_problems, first_lines, read_only, root_bypass_dropped
from dfq_testing.pipeline_shards import FLAG_EVERYTHING
from dfq_testing.polling import wait_for_states, wait_until

SAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sharegpt_sample.jsonl"
pytestmark = pytest.mark.slow


def test_a_read_only_shards_directory_is_waited_out(make_config, redis_url, start_worker, tmp_path):
    config = make_config(
        broker={"retry_backoff_max_s": 1.0},
        dataset={"shard_size": 4, "thinking": "never"},
        quality=FLAG_EVERYTHING,
        **{"generate.sampling": {"max_tokens": 16}},
    )
    dataset = first_lines(SAMPLE, 16, tmp_path / "prompts.jsonl")
    shards_dir = Path(config.storage.url) / "shards"
    shards_dir.mkdir(parents=True)
    slow = {ENV: json.dumps({"task_delay_s": 0.3})}
    obeying = tuple(root_bypass_dropped())
    workers = [start_worker(config, lane, env=slow, prefix=obeying) for lane in ("generate", "extract")]
    ledger = Ledger.from_url(redis_url, config.run.name)

    with read_only(shards_dir):
        report = Producer(config, ledger).enqueue([dataset])
        assert report.enqueued == 4
        wait_until(lambda: ledger.counters().get("storage_retries", 0) >= 3, 180, "storage retries", workers)
        assert list(shards_dir.iterdir()) == []  # no partial or temporary file was left behind

    wait_for_states(ledger, report.shard_ids, {DONE}, timeout=300, workers=workers)
    assert exactly_once_problems(config, dataset) == []
    assert sorted(p.suffix for p in shards_dir.iterdir()) == [".safetensors"] * 4
    counters = ledger.counters()
    assert counters["storage_retries"] >= 3 and counters["extract_shards"] == 4
    extract_log = workers[1].log_tail(1_000_000)
    assert "storage unavailable" in extract_log and "EACCES" in extract_log
