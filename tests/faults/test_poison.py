"""Poison samples: one sample that always crashes an engine costs one dead letter, and requeueing it after the
cause is fixed completes its shard. Real redis, real workers, the tiny model; the crash is injected."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash_queue.cli import main
from dflash_queue.data.readers import read_dataset
from dflash_queue.data.samples import Sample
from dflash_queue.deadletters import DeadLetters
from dflash_queue.faults import ENV
from dflash_queue.producer import Producer
from dflash_queue.queue.app import configure_app
from dflash_queue.runstate.ledger import DONE, Ledger
from dflash_queue.shards.completions import decode_completions
from dflash_queue.shards.keys import completions_key, shard_key
from dflash_queue.shards.training import TrainingShard
from dflash_queue.storage import open_storage
from dfq_testing.jobs import assert_accounted, first_lines, wait_accounted
from dfq_testing.pipeline_shards import FLAG_EVERYTHING
from dfq_testing.polling import wait_for_states

SAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sharegpt_sample.jsonl"
pytestmark = pytest.mark.slow


def test_poison_samples_are_dead_lettered_alone_and_requeue_completes_them(make_config, redis_url, start_worker, tmp_path):
    config = make_config(
        dataset={"shard_size": 4, "thinking": "never"}, quality=FLAG_EVERYTHING, **{"generate.sampling": {"max_tokens": 12}}
    )
    configure_app(config)
    dataset = first_lines(SAMPLE, 12, tmp_path / "prompts.jsonl")
    ids = [s.id for s in read_dataset([dataset], max_record_bytes=1 << 20) if isinstance(s, Sample)]
    poison = {"extract": ids[5], "generate": ids[9]}
    faulty = {ENV: json.dumps({"extract_poison": [poison["extract"]], "generate_poison": [poison["generate"]]})}
    workers = [start_worker(config, "generate", env=faulty), start_worker(config, "extract", env=faulty)]

    ledger = Ledger.from_url(redis_url, config.run.name)
    report = Producer(config, ledger).enqueue([dataset])
    wait_for_states(ledger, report.shard_ids, {DONE}, timeout=300, workers=workers)

    dead = DeadLetters.from_url(redis_url, config.run.name)
    records = dead.all()
    assert sorted((r.lane, r.kind, tuple(r.sample_ids), r.exc_type) for r in records) == [
        ("extract", "sample", (poison["extract"],), "InjectedFault"),
        ("generate", "sample", (poison["generate"],), "InjectedFault"),
    ]
    assert all("injected" in r.message and r.traceback and r.worker and r.deliveries == 1 for r in records)
    assert_accounted(config, dataset, done=10, dead=2)
    storage = open_storage(config.storage)
    before = {}
    for shard_id in report.shard_ids:
        with storage.local_copy(shard_key(shard_id)) as path:
            assert not set(poison.values()) & set(TrainingShard(path).sample_ids)
        before.update({r.id: r for r in decode_completions(storage.read_bytes(completions_key(shard_id)), what="")})

    # Fixed: workers without the fault; requeue everything.
    for worker in workers:
        worker.stop()
    workers = [start_worker(config, "generate"), start_worker(config, "extract")]
    runner = CliRunner()
    dry = runner.invoke(main, ["dead", "requeue", "--all", "--dry-run", "-c", config.source])
    assert dry.exit_code == 0 and dry.output.count("would send") == 2 and dead.count() == 2, dry.output
    result = runner.invoke(main, ["dead", "requeue", "--all", "-c", config.source])
    assert result.exit_code == 0 and result.output.count("sent:") == 2, result.output
    again = runner.invoke(main, ["dead", "requeue", "--all", "-c", config.source])
    assert "sent:" not in again.output  # nothing left to send twice

    wait_accounted(config, dataset, done=12, dead=0, workers=workers)
    assert dead.count() == 0
    after = {}
    for shard_id in report.shard_ids:
        after.update({r.id: r for r in decode_completions(storage.read_bytes(completions_key(shard_id)), what="")})
    # The generate redo generated the missing sample only; the others kept their completions.
    assert set(after) == set(ids) and set(before) == set(ids) - {poison["generate"]}
    assert all(after[i].completion_ids == before[i].completion_ids for i in before)
