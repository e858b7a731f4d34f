"""The chaos soak's short version: a job through every kind of fault with a fixed seed, every invariant holding at
the end (tools/soak.py; its long run's figures are in docs/benchmarks.md)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
from soak import FAULTS, schedule  # noqa: E402

pytestmark = pytest.mark.slow
SHORT = ["--duration", "30", "--mean-gap-s", "5", "--seed", "35", "--shards", "24", "--storage", "local"]


def test_a_seed_fixes_the_schedule_and_the_short_one_has_every_fault():
    assert schedule(35, 30, 5) == schedule(35, 30, 5) != schedule(36, 30, 5)
    assert {kind for _, kind, _, _ in schedule(35, 30, 5)} == set(FAULTS)


def test_the_short_soak_ends_with_every_sample_exactly_once(tmp_path):
    result = subprocess.run(
        [sys.executable, str(REPO / "tools" / "soak.py"), *SHORT, "--workdir", str(tmp_path / "soak"),
         "--timeout", "300"],
        capture_output=True, text=True, timeout=600,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0 and "soak: OK" in out, out[-4000:]
    assert "missing: 0" in out and "duplicated: 0" in out
    for kind in FAULTS:
        assert re.search(rf"^\s+[\d.]+ s  {kind}\b", out, re.M), (kind, out[-4000:])
    assert "job finished after" in out and re.search(r"shards redone: \d+", out)
    assert re.search(r"next shard stored +[\d.]+ s after", out)  # the time lost to a fault
