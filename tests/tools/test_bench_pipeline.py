"""The pipeline benchmark's accounting of a worker's idle time between tasks."""

from __future__ import annotations

import importlib.util
import sys
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
