"""A worker whose engine fails its state checks on too many of the shards it checked last stops instead of emptying
the queue into the dead letters: real `dflash-queue worker extract` subprocesses on the tiny model, a real
redis-server, and the fault that breaks packing after the engine's load probe (so that every shard's canary fails)
on every shard or on chosen ones.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis
from rich.console import Console

from dflash_queue.data.readers import read_dataset
from dflash_queue.data.samples import Sample
from dflash_queue.deadletters import DeadLetters
from dflash_queue.faults import ENV
from dflash_queue.lanes.generate import GenerateLane, build_generate_engine, generate_lane_settings
from dflash_queue.lanes.registry import EXTRACT
from dflash_queue.ops.status import collect_status
from dflash_queue.ops.status_view import status_table
from dflash_queue.queue.app import configure_app
from dflash_queue.queue.tasks import LANE_TASKS
from dflash_queue.runstate.ledger import DONE, FAILED, GENERATED, Ledger
from dflash_queue.runstate.stopped_workers import EXIT_FAILING_CHECKS
from dflash_queue.shards.keys import prompts_key, shard_key
from dflash_queue.shards.prompts import encode_prompts, prompt_shard_id
from dflash_queue.storage import open_storage
from dfq_testing.pipeline_shards import FLAG_EVERYTHING
from dfq_testing.polling import wait_for_states

SAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sharegpt_sample.jsonl"
pytestmark = pytest.mark.slow


def generated_shards(make_config, count: int, **extract):
    """`count` shards of 2 completions each, generated in this process; their extract tasks not yet sent."""
    config = make_config(
        dataset={"shard_size": 2, "thinking": "never"},
        **{"generate.sampling": {"max_tokens": 12}},
        extract={"canary_samples": 1, **extract},
        quality=FLAG_EVERYTHING,
    )
    configure_app(config)
    storage = open_storage(config.storage)
    samples = [s for s in read_dataset([SAMPLE], max_record_bytes=1 << 20) if isinstance(s, Sample)][: 2 * count]
    ledger = Ledger.from_url(config.broker.connection_url(), config.run.name)
    generate = GenerateLane(generate_lane_settings(config), build_generate_engine(config), storage)
    shard_ids = []
    for begin in range(0, len(samples), 2):
        shard_id = prompt_shard_id(samples[begin : begin + 2])
        storage.write_bytes(prompts_key(shard_id), encode_prompts(samples[begin : begin + 2]))
        generate.run(shard_id)
        ledger.set_state(shard_id, GENERATED, num_samples=2)
        shard_ids.append(shard_id)
    generate.close()
    return config, storage, ledger, shard_ids


def send(config, shard_ids) -> None:
    for shard_id in shard_ids:
        LANE_TASKS["extract"].apply_async(args=(shard_id, 2, config.fingerprint()), queue=EXTRACT.queue)


def test_a_worker_whose_canary_fails_on_every_shard_stops_after_three_and_leaves_the_rest_queued(
    make_config, redis_url, start_worker
):
    config, storage, ledger, shard_ids = generated_shards(make_config, 6)
    broken = {ENV: json.dumps({"extract_break_packing": True})}
    worker = start_worker(config, "extract", env=broken)
    send(config, shard_ids)

    assert worker.process.wait(timeout=300) == EXIT_FAILING_CHECKS, worker.log_tail()
    log = worker.log_tail(20000)
    assert "the transformers extract engine failed its state checks on 3 of the 3 shards it checked " \
           "(extract.stop_after_failed_checks = 3 within extract.failed_checks_window = 10): shard " in log
    assert "CanaryMismatch: canary sample " in log

    # Two dead letters, the third shard handed back, the other three never taken: four wait in the queue.
    records = DeadLetters.from_url(redis_url, config.run.name).all()
    assert len(records) == 2 and {r.exc_type for r in records} == {"CanaryMismatch"}
    broker = redis.Redis.from_url(redis_url)
    assert broker.llen(EXTRACT.queue) == 4 and broker.hlen("unacked") == 0
    dead = {r.shard_id for r in records}
    states = ledger.states(shard_ids)
    assert {s for s, state in states.items() if state == FAILED} == dead
    assert all(state == GENERATED for s, state in states.items() if s not in dead)
    assert not any(storage.exists(shard_key(s)) for s in shard_ids)

    # `status` says which worker stopped, with which engine, why, and on which shards.
    status = collect_status(config, inspect_timeout=1.0)
    [stopped] = status.stopped_workers
    assert (stopped.node, stopped.lane, stopped.engine, stopped.exit_status) == (
        worker.hostname, "extract", "transformers", EXIT_FAILING_CHECKS
    )
    assert len(stopped.failures) == 3 and {shard for shard, _ in stopped.failures[:2]} == dead
    assert stopped.failures[2][0] not in dead  # the shard handed back
    assert all(message.startswith("CanaryMismatch: canary sample ") for _, message in stopped.failures)
    assert status.to_json()["stopped_workers"][0]["reason"] == stopped.reason
    console = Console(width=400, record=True)
    console.print(status_table(status))
    text = console.export_text()
    assert f"worker {worker.hostname} (extract) stopped" in text and "exit status 78, not restarted" in text
    assert "failed its state checks on 3 of the 3 shards it checked" in text

    # A healthy worker takes the four shards that waited.
    healthy = start_worker(config, "extract")
    waited = [s for s in shard_ids if s not in dead]
    wait_for_states(ledger, waited, {DONE}, timeout=300, workers=[healthy])
    assert all(storage.exists(shard_key(s)) for s in waited)


def test_a_failure_now_and_then_does_not_stop_a_worker_counting_failures_in_a_row(
    make_config, redis_url, start_worker
):
    """With a limit of 2 within a window of 2 (failures in a row), shards failing with a passing shard between them
    never make two (within the default window of 10 they would)."""
    config, storage, ledger, shard_ids = generated_shards(make_config, 5, stop_after_failed_checks=2,
                                                          failed_checks_window=2)
    failing = [shard_ids[0], shard_ids[2]]
    broken = {ENV: json.dumps({"extract_break_packing": failing})}
    # One task at a time, so that the shards are checked in the order they were sent.
    worker = start_worker(config, "extract", env=broken, extra_args=("--concurrency", "1"))
    send(config, shard_ids)

    states = wait_for_states(ledger, shard_ids, {DONE, FAILED}, timeout=300, workers=[worker])
    assert {s for s, state in states.items() if state == FAILED} == set(failing)
    assert worker.alive(), worker.log_tail()
    records = DeadLetters.from_url(redis_url, config.run.name).all()
    assert sorted(r.shard_id for r in records) == sorted(failing)
    assert {r.exc_type for r in records} == {"CanaryMismatch"}
    assert collect_status(config, inspect_timeout=1.0).stopped_workers == []
    assert all(storage.exists(shard_key(s)) for s in shard_ids if s not in failing)
