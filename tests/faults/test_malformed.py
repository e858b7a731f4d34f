"""Malformed messages on the queues (bad JSON, not JSON, unknown task, wrong arguments): each becomes a dead
letter, and the workers that received them go on to finish a real job."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from dflash_queue.deadletters import DeadLetters
from dflash_queue.lanes.registry import EXTRACT, GENERATE
from dflash_queue.producer import Producer
from dflash_queue.queue.app import configure_app
from dflash_queue.runstate.ledger import DONE, Ledger
from dfq_testing.jobs import assert_accounted
from dfq_testing.pipeline_shards import FLAG_EVERYTHING
from dfq_testing.polling import wait_for_states

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def publish_raw(app, queue: str, body: bytes, *, content_type: str, headers: dict | None) -> None:
    with app.connection_for_write() as connection:
        connection.Producer().publish(
            body,
            exchange=queue,
            routing_key=queue,
            content_type=content_type,
            content_encoding="utf-8",
            headers=headers or {},
            declare=[q for q in app.conf.task_queues if q.name == queue],
        )


def test_malformed_messages_are_dead_lettered_and_workers_carry_on(make_config, redis_url, start_worker, tmp_path):
    config = make_config(dataset={"shard_size": 4}, quality=FLAG_EVERYTHING, **{"generate.sampling": {"max_tokens": 8}})
    app = configure_app(config)
    workers = [start_worker(config, "generate"), start_worker(config, "extract")]
    headers = {"lang": "py", "task": GENERATE.task_name, "id": "bad-json", "argsrepr": "", "kwargsrepr": ""}
    publish_raw(app, GENERATE.queue, b'[["shard", 4, "fp"], {}, {', content_type="application/json", headers=headers)
    publish_raw(app, GENERATE.queue, b"{not json at all", content_type="application/json", headers=None)
    publish_raw(app, EXTRACT.queue, b"\x80\x04K\x01.", content_type="application/x-python-serialize",
                headers={**headers, "task": EXTRACT.task_name, "id": "pickled"})
    app.send_task("dfq.no_such_task", args=["x"], queue=GENERATE.queue, task_id="unknown-task")
    app.send_task(GENERATE.task_name, args=["some-shard"], queue=GENERATE.queue, task_id="too-few-args")
    app.send_task(EXTRACT.task_name, args=[1, 2, 3, 4, 5, 6], queue=EXTRACT.queue, task_id="too-many-args")

    dead = DeadLetters.from_url(redis_url, config.run.name)
    deadline = time.monotonic() + 120
    while dead.count() < 6 and time.monotonic() < deadline:
        time.sleep(0.2)
    records = dead.all()
    described = sorted((r.lane, r.kind, r.exc_type) for r in records)
    assert len(records) == 6, json.dumps(described) + "\n" + "\n".join(w.log_tail() for w in workers)
    by_reason = {r.kwargs.get("reason") or r.exc_type: r for r in records}
    assert {"undecodable message", "unknown task"} <= set(by_reason), described
    assert sum(r.exc_type == "TypeError" for r in records) == 2  # wrong arguments, to either lane
    assert not any(r.requeueable for r in records if r.kind == "message")
    assert all(w.alive() for w in workers)

    # The same workers still do real work.
    lines = (REPO / "examples" / "sharegpt_sample.jsonl").read_text().splitlines()[:8]
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("\n".join(lines) + "\n")
    ledger = Ledger.from_url(redis_url, config.run.name)
    report = Producer(config, ledger).enqueue([dataset])
    wait_for_states(ledger, report.shard_ids, {DONE}, timeout=300, workers=workers)
    assert_accounted(config, dataset, done=8)
    assert dead.count() == 6
