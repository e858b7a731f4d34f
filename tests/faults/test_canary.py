"""The run-time canary with real workers: an extract worker whose packing is broken after its load probe (fault
injection) fails every shard for good, each dead letter naming the canary sample, the layer and the error, and no
wrong shard is stored; `status` shows the canary's figures of a healthy run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_queue.deadletters import DeadLetters
from dflash_queue.faults import ENV
from dflash_queue.ops.status import collect_status
from dflash_queue.ops.status_view import status_table
from dflash_queue.producer import Producer
from dflash_queue.queue.app import configure_app
from dflash_queue.runstate.ledger import DONE, FAILED, Ledger
from dflash_queue.shards.keys import shard_key
from dflash_queue.storage import open_storage
from dfq_testing.jobs import first_lines
from dfq_testing.pipeline_shards import FLAG_EVERYTHING
from dfq_testing.polling import wait_for_states

SAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sharegpt_sample.jsonl"
pytestmark = pytest.mark.slow


def hybrid_config(make_config, tiny_family, name: str):
    return make_config(
        name,
        model={"path": str(tiny_family("qwen3_5")), "name": "qwen3_5", "dtype": "float32", "device": "cpu"},
        dataset={"shard_size": 4, "thinking": "never"},
        extract={"num_draft_layers": 3, "token_budget": 160, "hidden_dtype": "bfloat16"},
        quality=FLAG_EVERYTHING,
        **{"generate.sampling": {"max_tokens": 12}},
    )


def test_broken_packing_is_dead_lettered_by_the_canary(make_config, tiny_family, redis_url, start_worker, tmp_path):
    config = hybrid_config(make_config, tiny_family, "broken.toml")
    configure_app(config)
    dataset = first_lines(SAMPLE, 8, tmp_path / "prompts.jsonl")
    broken = {ENV: json.dumps({"extract_break_packing": True})}
    workers = [start_worker(config, "generate"), start_worker(config, "extract", env=broken)]

    ledger = Ledger.from_url(redis_url, config.run.name)
    report = Producer(config, ledger).enqueue([dataset])
    wait_for_states(ledger, report.shard_ids, {FAILED}, timeout=300, workers=workers)

    records = DeadLetters.from_url(redis_url, config.run.name).all()
    assert sorted(r.shard_id for r in records) == sorted(report.shard_ids)
    for record in records:
        assert (record.lane, record.kind, record.exc_type, record.deliveries) == ("extract", "task", "CanaryMismatch", 1)
        assert "canary sample " in record.message and "differs from the sample run alone by relative error" in record.message
        assert " layer " in record.message and "tolerance 2.0e-02" not in record.message  # float32 model: 1e-4
    storage = open_storage(config.storage)
    assert not any(storage.exists(shard_key(s)) for s in report.shard_ids)


def test_status_shows_the_canary_of_a_healthy_run(make_config, tiny_family, redis_url, start_worker, tmp_path):
    config = hybrid_config(make_config, tiny_family, "healthy.toml")
    configure_app(config)
    dataset = first_lines(SAMPLE, 8, tmp_path / "prompts.jsonl")
    workers = [start_worker(config, "generate"), start_worker(config, "extract")]
    ledger = Ledger.from_url(redis_url, config.run.name)
    report = Producer(config, ledger).enqueue([dataset])
    wait_for_states(ledger, report.shard_ids, {DONE}, timeout=300, workers=workers)

    status = collect_status(config, inspect_timeout=2.0)
    extract = status.lanes["extract"]
    assert extract.canary_samples == 2 and extract.canary_worst_error is not None
    assert 0 <= extract.canary_worst_error <= 1e-4
    assert status.to_json()["lanes"]["extract"]["canary_worst_error"] == extract.canary_worst_error

    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(status_table(status))
    assert "2 samples rerun alone, worst relative error" in console.export_text()
