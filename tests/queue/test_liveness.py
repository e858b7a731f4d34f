"""A worker killed with SIGKILL: the messages it held come back when its heartbeat stops, long before the
visibility timeout; `status` shows them held by a dead worker meanwhile. Real redis, real workers."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from dflash_queue.faults import ENV
from dflash_queue.ledger import DONE, GENERATED, Ledger
from dflash_queue.ops.status import WorkerView, collect_status
from dflash_queue.producer import Producer
from dflash_queue.queue.app import configure_app
from dflash_queue.verify import verify
from dfq_testing.jobs import first_lines
from dfq_testing.polling import wait_for_states, wait_until
from tests.faults.test_kill import delivery_counts, wait_for_unacked

SAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sharegpt_sample.jsonl"
pytestmark = pytest.mark.slow
LIVENESS_S = 6


def test_a_killed_workers_messages_come_back_after_its_heartbeat_not_the_visibility_timeout(
    make_config, redis_url, start_worker, tmp_path
):
    config = make_config(
        broker={"visibility_timeout_s": 3600, "task_timeout_s": 600, "worker_liveness_s": LIVENESS_S},
        dataset={"shard_size": 4, "thinking": "never"},
        **{"generate.sampling": {"max_tokens": 8}},
    )
    configure_app(config)
    dataset = first_lines(SAMPLE, 8, tmp_path / "prompts.jsonl")
    ledger = Ledger.from_url(redis_url, config.run.name)
    doomed = start_worker(config, "generate", env={ENV: json.dumps({"task_delay_s": 30})})
    report = Producer(config, ledger).enqueue([dataset])
    wait_for_unacked(redis_url, "generate")
    # Killed once its task has begun (its delivery counted), not while the message waits in the worker's prefetch.
    wait_until(lambda: delivery_counts(redis_url, config.run.name) == [1], 60, "the doomed worker's task started")
    doomed.kill()
    killed_at = time.monotonic()

    def held_by_dead():
        lane = collect_status(config, workers=WorkerView()).lanes["generate"]
        return lane if lane.held_by_dead else None

    lane = wait_until(held_by_dead, 3 * LIVENESS_S, "the killed worker's message shown held by a dead worker")
    assert lane.held_by_dead == 1 and lane.reserved == 1
    assert lane.held_back_in_s is not None and lane.held_back_in_s <= LIVENESS_S * 4 / 3
    assert lane.eta_s is None or lane.eta_s >= lane.held_back_in_s

    # verify says why each sample is missing and what brings it back.
    accounted = verify(config, [dataset])
    reasons = sorted(set(accounted.missing.values()))
    assert len(accounted.missing) == 8 and len(reasons) == 2, reasons
    assert any(f"held by {doomed.hostname}, a worker whose heartbeat stopped" in r for r in reasons), reasons
    assert any("waiting in the generate queue" in r for r in reasons), reasons

    survivor = start_worker(config, "generate")
    wait_for_states(ledger, report.shard_ids, {GENERATED, DONE}, timeout=120, workers=[survivor])
    assert time.monotonic() - killed_at < 90  # the visibility timeout is an hour
    assert 2 in delivery_counts(redis_url, config.run.name)  # the killed delivery counted
    assert collect_status(config, workers=WorkerView()).lanes["generate"].held_by_dead == 0
