"""The lane registry is the one declaration every consumer reads: the pipeline it declares is whole, and the
Celery app, tasks, dead letters and requeue take their queues, tasks and states from it."""

from __future__ import annotations

import importlib

import pytest

from dflash_queue.deadletters import SAMPLE, TASK, DeadLetter, record_id
from dflash_queue.deadletters.recording import dead_letter_task
from dflash_queue.deadletters.requeue import plan
from dflash_queue.lanes.registry import (
    AUDIT,
    EXTRACT,
    FINAL_LANE,
    FIRST_LANE,
    GENERATE,
    LANES,
    PIPELINE,
    lane,
    lane_of_task,
)
from dflash_queue.queue.app import LaneApp, celery_settings
from dflash_queue.queue.tasks import LANE_TASKS
from dflash_queue.runstate.ledger import DONE, GENERATED, QUEUED


def test_the_pipeline_runs_from_the_first_lane_to_the_final_one_through_every_pipeline_lane():
    order, spec = [], FIRST_LANE
    while spec is not None:
        order.append(spec.name)
        spec = LANES[spec.next_lane] if spec.next_lane is not None else None
    assert order == [spec.name for spec in PIPELINE] == ["generate", "extract"]
    assert FINAL_LANE is EXTRACT and FIRST_LANE is GENERATE
    # The audit is a side lane: no lane leads to it, it leads nowhere, and it leaves a shard's state as it was.
    assert list(LANES) == ["generate", "extract", "audit"] and not AUDIT.pipeline and AUDIT.next_lane is None
    assert all(spec.next_lane != AUDIT.name for spec in LANES.values())
    assert AUDIT.waiting_state == AUDIT.finished_state == DONE and not AUDIT.pending_states
    # A shard a lane leaves behind is waiting for the next lane, and done for this one.
    assert GENERATE.finished_state == EXTRACT.waiting_state == GENERATED
    assert GENERATE.waiting_state == QUEUED and EXTRACT.finished_state == DONE
    for spec in PIPELINE:
        assert spec.finished_state in spec.done_states and spec.waiting_state in spec.pending_states
        assert not spec.done_states & spec.pending_states


def test_lanes_are_found_by_name_and_by_task_name():
    for name, spec in LANES.items():
        assert lane(name) is spec and lane_of_task(spec.task_name) is spec
    assert lane_of_task("dfq.no_such_task") is None
    with pytest.raises(ValueError, match=r"unknown lane 'verify'; expected one of \['audit', 'extract', 'generate'\]"):
        lane("verify")


def test_each_builder_names_a_function_of_the_lane_module():
    for spec in LANES.values():
        module, _, function = spec.builder.partition(":")
        assert callable(getattr(importlib.import_module(module), function)), spec.builder


def test_celery_queues_routes_and_tasks_come_from_the_registry(make_config):
    config = make_config()
    settings = celery_settings(config.broker, config.source)
    assert [q.name for q in settings["task_queues"]] == [spec.queue for spec in LANES.values()]
    assert settings["task_routes"] == {
        spec.task_name: {"queue": spec.queue, "routing_key": spec.queue} for spec in LANES.values()
    }
    assert settings["task_default_queue"] == FIRST_LANE.queue
    assert {name: task.name for name, task in LANE_TASKS.items()} == {n: s.task_name for n, s in LANES.items()}


def test_dead_letters_and_requeue_name_the_lane_of_the_task(redis_url):
    from dflash_queue.deadletters import DeadLetters

    dead = DeadLetters.from_url(redis_url, "registry")
    record = dead_letter_task(dead, EXTRACT.task_name, ["s1", 4, "fp"], {}, RuntimeError("boom"), deliveries=1,
                              worker="w")
    assert record.lane == "extract" and dead.get(record.id) is not None
    unknown = dead_letter_task(dead, "dfq.gone", ["s2", 4, "fp"], {}, RuntimeError("x"), deliveries=1, worker="w")
    assert unknown.lane == "unknown"
    sample = DeadLetter(record_id(SAMPLE, "generate", "s3", ["a"]), SAMPLE, "generate", GENERATE.task_name, "s3")
    jobs, unrunnable = plan([record, unknown, sample], [record, unknown, sample])
    assert [(j.lane, j.shard_id, j.redo) for j in jobs] == [("extract", "s1", False), ("generate", "s3", True)]
    assert unrunnable == [unknown]
    assert record.kind == TASK


def test_a_process_without_a_worker_runtime_says_how_to_start_one():
    with pytest.raises(RuntimeError, match="start workers with `dflash-queue worker`"):
        LaneApp("nothing-attached").runtime()


def test_extract_task_slots_and_start_up_warnings_follow_the_engine(make_config):
    transformers = make_config()
    assert EXTRACT.default_slots(transformers) == 1 + transformers.storage.uploader.max_pending
    assert EXTRACT.startup_warnings(transformers, 3) == []
    vllm = make_config(
        "vllm.toml",
        dataset={"max_model_len": 2048},
        extract={"engine": "vllm"},
        **{"extract.vllm": {"inflight_tasks": 3}, "storage.uploader": {"max_pending": 2, "parallel_uploads": 1}},
    )
    assert EXTRACT.default_slots(vllm) == 3 + 2
    (slots,) = EXTRACT.startup_warnings(vllm, 5)
    assert "max_pending (2) is below extract.vllm.inflight_tasks (3)" in slots
    short = make_config("short.toml", dataset={"max_model_len": 2048}, extract={"engine": "vllm"},
                        **{"extract.vllm": {"max_model_len": 2048}})
    (context,) = EXTRACT.startup_warnings(short, 4)
    assert "context (2048 tokens) holds sequences of at most 2047 tokens" in context and "staging admits 2048" in context
