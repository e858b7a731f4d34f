"""The pipeline benchmark: its accounting of a worker's idle time between tasks, and a direct way that overlaps its
two lanes as the workers do (else the queue is credited with the overlap)."""

from __future__ import annotations

import importlib.util
import queue
import sys
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent.parent


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_pipeline", REPO / "tools" / "bench_pipeline.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_dispatch_gaps_count_only_time_a_waiting_message_was_not_running(bench):
    tasks = [
        bench.TaskTimes("generate", "a", sent=0.0, started=0.1, succeeded=1.0),
        # Sent while the first ran: waiting behind it is no gap; from its end to this start is.
        bench.TaskTimes("generate", "b", sent=0.05, started=1.02, succeeded=2.0),
        # Sent after the worker went idle: from sending to start.
        bench.TaskTimes("generate", "c", sent=3.0, started=3.01, succeeded=4.0),
    ]
    assert bench.dispatch_gaps(tasks) == pytest.approx(0.1 + 0.02 + 0.01)


def test_the_direct_lanes_hand_each_shard_on_as_soon_as_it_is_generated(bench):
    """Shard b is generated while shard a is extracted, as in the pipeline: generating b waits until a is being
    extracted, which a hand-over after the whole job would never allow."""
    handed: queue.Queue = queue.Queue()
    extracting_a = threading.Event()
    waited: list[bool] = []

    def generate(shard: str) -> None:
        if shard == "b":
            waited.append(extracting_a.wait(timeout=10))

    def extract(shard: str) -> None:
        if shard == "a":
            extracting_a.set()

    shards = iter(["a", "b", "c"])

    def generate_side() -> None:
        bench.work_through(lambda: next(shards, None), generate, 1, handed.put)
        handed.put(None)  # the end of the job

    thread = threading.Thread(target=generate_side)
    thread.start()
    extracted: list[str] = []
    bench.work_through(handed.get, extract, 1, extracted.append)
    thread.join()
    assert waited == [True] and extracted == ["a", "b", "c"]


def test_a_direct_lane_runs_as_many_shards_at_once_as_its_worker_has_slots(bench):
    together = threading.Barrier(3, timeout=10)  # broken unless three shards run at once
    shards = iter(["a", "b", "c"])
    done: list[str] = []
    bench.work_through(lambda: next(shards, None), lambda shard: together.wait(), 3, done.append)
    assert sorted(done) == ["a", "b", "c"]
