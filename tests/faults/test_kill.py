"""Workers killed with SIGKILL mid-task (as the OOM killer would): the message comes back after the visibility
timeout and another worker finishes it; a task that kills every worker that runs it is dead-lettered after
broker.max_deliveries. Real redis, real workers, the tiny model."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner

from dflash_queue.cli import main
from dflash_queue.deadletters import DeadLetters
from dflash_queue.faults import ENV
from dflash_queue.producer import Producer
from dflash_queue.queue.app import configure_app
from dflash_queue.runstate.ledger import DONE, FAILED, Ledger
from dfq_testing.jobs import assert_accounted, first_lines
from dfq_testing.pipeline_shards import FLAG_EVERYTHING
from dfq_testing.polling import wait_for_states

SAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sharegpt_sample.jsonl"
pytestmark = pytest.mark.slow
# Short enough that a killed worker's message comes back within the test, longer than any task here.
BROKER = {"visibility_timeout_s": 12, "task_timeout_s": 10, "max_deliveries": 2}


def wait_for_unacked(redis_url: str, queue: str, timeout: float = 120) -> None:
    """Until a message of `queue` is held, unacked, by a worker: that worker is mid-task."""
    client = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for raw in client.hvals("unacked"):
            _message, _exchange, routing_key = json.loads(raw)
            if routing_key == queue:
                return
        time.sleep(0.05)
    raise AssertionError(f"no {queue} task started within {timeout}s")


def delivery_counts(redis_url: str, run: str) -> list[int]:
    return sorted(Ledger.from_url(redis_url, run).deliveries().values())


def test_killed_workers_lose_nothing_and_double_nothing(make_config, redis_url, start_worker, tmp_path):
    config = make_config(broker={**BROKER, "max_deliveries": 3}, dataset={"shard_size": 4, "thinking": "never"},
                         quality=FLAG_EVERYTHING, **{"generate.sampling": {"max_tokens": 12}})
    configure_app(config)
    dataset = first_lines(SAMPLE, 16, tmp_path / "prompts.jsonl")
    slow = {ENV: json.dumps({"task_delay_s": 1.5})}
    ledger = Ledger.from_url(redis_url, config.run.name)
    generate = start_worker(config, "generate", env=slow)
    report = Producer(config, ledger).enqueue([dataset])

    wait_for_unacked(redis_url, "generate")
    generate.kill()
    generate = start_worker(config, "generate")
    extract = start_worker(config, "extract", env=slow)
    wait_for_unacked(redis_url, "extract")
    extract.kill()
    extract = start_worker(config, "extract")

    wait_for_states(ledger, report.shard_ids, {DONE}, timeout=300, workers=[generate, extract])
    assert_accounted(config, dataset, done=16)
    assert DeadLetters.from_url(redis_url, config.run.name).count() == 0
    counters = ledger.counters()
    assert (counters["generate_shards"], counters["extract_shards"]) == (4, 4)  # counted once each
    assert counters["generate_samples"] == counters["extract_samples"] == 16
    # The two killed tasks were delivered again. (With so short a visibility timeout, a task waiting behind
    # another in a worker may be handed out a second time too: harmless, as the outputs above show.)
    counts = delivery_counts(redis_url, config.run.name)
    assert len(counts) == 8 and sum(c >= 2 for c in counts) >= 2 and max(counts) <= 3, counts


def test_a_task_that_kills_every_worker_is_dead_lettered_after_max_deliveries(
    make_config, redis_url, start_worker, tmp_path
):
    config = make_config(broker=BROKER, dataset={"shard_size": 4, "thinking": "never"}, quality=FLAG_EVERYTHING,
                         **{"generate.sampling": {"max_tokens": 8}})
    configure_app(config)
    dataset = first_lines(SAMPLE, 8, tmp_path / "prompts.jsonl")
    ledger = Ledger.from_url(redis_url, config.run.name)
    report = Producer(config, ledger).enqueue([dataset])
    deadly = report.shard_ids[0]
    env = {ENV: json.dumps({"kill_on_shards": [deadly]})}
    extract = start_worker(config, "extract")

    # Like systemd's Restart=always: a worker that dies is started again.
    deaths = 0
    generate = start_worker(config, "generate", env=env, wait=False)
    deadline = time.monotonic() + 240
    while set(ledger.states(report.shard_ids).values()) != {DONE, FAILED}:
        assert time.monotonic() < deadline, ledger.states(report.shard_ids)
        if not generate.alive():
            deaths += 1
            generate = start_worker(config, "generate", env=env, wait=False)
        time.sleep(0.2)

    assert deaths == BROKER["max_deliveries"]
    [record] = DeadLetters.from_url(redis_url, config.run.name).all()
    assert (record.lane, record.kind, record.shard_id, record.exc_type) == ("generate", "task", deadly, "DeliveryLimitExceeded")
    assert record.deliveries == 3 and "died" in record.message
    assert generate.alive() and extract.alive()
    assert_accounted(config, dataset, done=4, dead=4)

    # Fixed (a worker without the fault): requeued, the shard completes and its dead letter is gone.
    generate.stop()
    generate = start_worker(config, "generate")
    result = CliRunner().invoke(main, ["dead", "requeue", record.id, "-c", config.source])
    assert result.exit_code == 0 and "sent:" in result.output, result.output
    wait_for_states(ledger, report.shard_ids, {DONE}, timeout=300, workers=[generate, extract])
    assert_accounted(config, dataset, done=8, dead=0)
