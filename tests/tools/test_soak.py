"""The chaos soak's short version: a job through every kind of fault with a fixed seed, every invariant holding at
the end (tools/soak.py; its long run's figures are in docs/benchmarks.md)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
from soak import FAULTS, schedule  # noqa: E402

from dfq_testing.processes import TreeWatch, descendants, describe  # noqa: E402

pytestmark = pytest.mark.slow
SHORT = ["--duration", "30", "--mean-gap-s", "5", "--seed", "35", "--shards", "24", "--storage", "local"]


def test_a_seed_fixes_the_schedule_and_the_short_one_has_every_fault():
    assert schedule(35, 30, 5) == schedule(35, 30, 5) != schedule(36, 30, 5)
    assert {kind for _, kind, _, _ in schedule(35, 30, 5)} == set(FAULTS)


def soak(tmp_path, tiny_model, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(REPO / "tools" / "soak.py"), *args, "--workdir", str(tmp_path / "soak"),
         "--model", str(tiny_model)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def test_the_short_soak_ends_with_every_sample_exactly_once_and_nothing_it_started_left_running(tmp_path, tiny_model):
    process = soak(tmp_path, tiny_model, *SHORT, "--timeout", "300")
    with TreeWatch(process.pid) as tree:
        out, _ = process.communicate(timeout=600)
    assert tree.survivors(timeout=5) == [], describe(tree.survivors(timeout=0))
    assert process.returncode == 0 and "soak: OK" in out, out[-4000:]
    assert len(tree.seen) >= 9  # the broker, four workers, their restarts, the enqueues
    assert "missing: 0" in out and "duplicated: 0" in out
    for kind in FAULTS:
        assert re.search(rf"^\s+[\d.]+ s  {kind}\b", out, re.M), (kind, out[-4000:])
    assert "job finished after" in out and re.search(r"shards redone: \d+", out)
    assert re.search(r"next shard stored +[\d.]+ s after", out)  # the time lost to a fault


def workers_running(pid: int) -> int:
    count = 0
    for child in descendants(pid):
        try:
            count += " worker " in " ".join(child.cmdline())
        except psutil.Error:
            pass
    return count


def test_a_soak_stopped_from_outside_stops_everything_it_started(tmp_path, tiny_model):
    """SIGTERM (a cancelled CI job, `kill`) mid-run: the workers, the enqueues and the broker go with it."""
    process = soak(tmp_path, tiny_model, *SHORT)
    with TreeWatch(process.pid) as tree:
        deadline = time.monotonic() + 300
        while workers_running(process.pid) < 4:
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()[0][-3000:]
            time.sleep(0.5)
        time.sleep(5)  # the faults under way
        process.send_signal(signal.SIGTERM)
        out, _ = process.communicate(timeout=120)
    assert tree.survivors(timeout=5) == [], describe(tree.survivors(timeout=0))
    assert process.returncode == 128 + signal.SIGTERM, out[-3000:]
