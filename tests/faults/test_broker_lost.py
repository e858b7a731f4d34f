"""The broker lost mid-job (queue, ledger and counters gone): `enqueue --rebuild` re-queues exactly the shards
not done, shards whose completions survived go straight to extraction, and the job ends exactly once.
Real redis-server, real workers and CLI, the tiny model."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import redis

from dflash_queue.faults import ENV
from dflash_queue.lanes.registry import GENERATE
from dflash_queue.producer import Producer
from dflash_queue.runstate.ledger import DONE, Ledger
from dflash_queue.shards.keys import COMPLETIONS, SHARDS, shard_id_of
from dflash_queue.storage import open_storage
from dfq_testing.commands import dflash_queue
from dfq_testing.jobs import connect, done_count, exactly_once_problems, first_lines
from dfq_testing.pipeline_shards import FLAG_EVERYTHING
from dfq_testing.polling import wait_for_states, wait_until

SAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sharegpt_sample.jsonl"
pytestmark = pytest.mark.slow
SLOW = {ENV: json.dumps({"task_delay_s": 0.5})}


def stored_ids(config, prefix: str) -> set[str]:
    return {shard_id_of(key) for key in open_storage(config.storage).list(prefix + "/")}


def test_a_lost_broker_is_rebuilt_from_storage(make_config, redis_url, start_worker, tmp_path):
    config = make_config(
        broker={"visibility_timeout_s": 30, "task_timeout_s": 20},
        dataset={"shard_size": 4, "thinking": "never"},
        quality=FLAG_EVERYTHING,
        **{"generate.sampling": {"max_tokens": 16}},
    )
    connect(config)
    dataset = first_lines(SAMPLE, 32, tmp_path / "prompts.jsonl")
    ledger = Ledger.from_url(redis_url, config.run.name)
    workers = [start_worker(config, "generate", env=SLOW), start_worker(config, "extract", env=SLOW)]
    report = Producer(config, ledger).enqueue([dataset])
    assert report.enqueued == 8

    wait_until(lambda: done_count(ledger, report.shard_ids) >= 2, 180, "two shards done", workers)
    generate, extract = workers
    extract.kill()
    # Generation runs ahead: some shards have their completions stored but no training file.
    wait_until(
        lambda: stored_ids(config, COMPLETIONS) - stored_ids(config, SHARDS), 120, "completions not extracted", [generate]
    )
    generate.kill()
    redis.Redis.from_url(redis_url).flushall()  # the broker is lost: no queue, no ledger, no counters

    done = stored_ids(config, SHARDS)
    not_done = set(report.shard_ids) - done
    generated = stored_ids(config, COMPLETIONS) & not_done
    assert done and generated and not_done, "the loss should land mid-job"

    result = dflash_queue("enqueue", dataset, "-c", config.source, "--rebuild", timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"shards: 8 ({len(not_done)} enqueued, {len(done)} already done; rebuild" in result.stdout
    messages = [json.loads(raw) for raw in redis.Redis.from_url(redis_url).lrange(GENERATE.queue, 0, -1)]
    assert sorted(json.loads(base64.b64decode(m["body"]))[0][0] for m in messages) == sorted(not_done)

    workers = [start_worker(config, "generate"), start_worker(config, "extract")]
    wait_for_states(ledger, sorted(not_done), {DONE}, timeout=300, workers=workers)
    assert exactly_once_problems(config, dataset) == []
    counters = ledger.counters()
    # Completions that survived are not generated again; every shard not done is extracted once.
    assert counters.get("generate_shards", 0) == len(not_done - generated)
    assert counters["extract_shards"] == len(not_done)
