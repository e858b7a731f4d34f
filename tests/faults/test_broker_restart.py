"""Redis restarted mid-job: queued and unacked messages come back from the AOF, the same workers reconnect and
finish the job, and every sample ends in exactly one shard. Real redis-server, real workers, the tiny model.

The broker stops while an extract task runs: that task's ack fails, so its message comes back after the
(short) visibility timeout and the re-delivery finds the shard stored."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis

from dflash_queue.broker.redis_server import RedisServer
from dflash_queue.faults import ENV
from dflash_queue.producer import Producer
from dflash_queue.runstate.ledger import DONE, Ledger
from dfq_testing.jobs import connect, done_count, exactly_once_problems, first_lines
from dfq_testing.pipeline_shards import FLAG_EVERYTHING
from dfq_testing.polling import wait_for_states, wait_until

SAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sharegpt_sample.jsonl"
pytestmark = pytest.mark.slow
# Slow enough that the restart lands while shards are still pending.
SLOW = {ENV: json.dumps({"task_delay_s": 0.5})}


def unacked_queues(url: str) -> set[str]:
    """Queues of the messages workers hold unacked (tasks running or waiting in a worker)."""
    return {json.loads(raw)[2] for raw in redis.Redis.from_url(url).hvals("unacked")}


def test_workers_reconnect_after_a_broker_restart_and_finish_exactly_once(make_config, start_worker, tmp_path):
    server = RedisServer(tmp_path / "broker", appendonly=True).start()
    workers: list = []  # stopped before their broker: after it, each warm shutdown would wait its whole timeout
    try:
        config = make_config(
            broker={"url": server.url, "visibility_timeout_s": 15, "task_timeout_s": 10},
            dataset={"shard_size": 4, "thinking": "never"},
            quality=FLAG_EVERYTHING,
            **{"generate.sampling": {"max_tokens": 16}},
        )
        connect(config)
        dataset = first_lines(SAMPLE, 24, tmp_path / "prompts.jsonl")
        workers += [start_worker(config, "generate", env=SLOW), start_worker(config, "extract", env=SLOW)]
        pids = [w.pid for w in workers]
        ledger = Ledger.from_url(server.url, config.run.name)
        report = Producer(config, ledger).enqueue([dataset])
        assert report.enqueued == 6

        # Stop the broker while an extract task runs (its message unacked), after a first shard is done.
        wait_until(
            lambda: done_count(ledger, report.shard_ids) >= 1 and "extract" in unacked_queues(server.url),
            180,
            "a shard done and an extract task running",
            workers,
        )
        server.stop()
        for worker in workers:
            wait_until(lambda worker=worker: "Connection to broker lost" in worker.log_tail(100_000), 60, "the outage noticed")
        server.start()  # same port and directory: the AOF brings back the queue, unacked messages and ledger

        wait_for_states(ledger, report.shard_ids, {DONE}, timeout=300, workers=workers)
        assert [w.pid for w in workers] == pids and all(w.alive() for w in workers)
        assert exactly_once_problems(config, dataset) == []
        counters = ledger.counters()
        assert counters["generate_shards"] == counters["extract_shards"] == 6
        assert counters["extract_samples"] == 24
    finally:
        for worker in workers:
            worker.stop(timeout=30)
        server.stop()
        connect(make_config("session.toml"))
