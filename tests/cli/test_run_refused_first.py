"""A second `run` of a state directory is refused before the command imports anything heavy (torch, Transformers,
vLLM, Celery): the refusal comes at once, not after the seconds those imports take."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from dflash_queue.run_lock import RunLock
from dfq_testing.configs import tiny_config_tables, write_config

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "examples" / "sharegpt_sample.jsonl"
HEAVY = {"torch", "transformers", "vllm", "celery"}


def imported_modules(importtime: str) -> set[str]:
    """Top-level names of the modules a `python -X importtime` run imported, from its stderr."""
    names = set()
    for line in importtime.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip().split(".")[0])
    return names


def test_a_second_run_is_refused_before_any_heavy_import(tmp_path):
    (tmp_path / "model").mkdir()  # a first run holds the lock: nothing of the model is read
    config = write_config(tmp_path / "run.toml", tiny_config_tables(tmp_path / "model", tmp_path / "out", "",
                                                                   tmp_path / "state"))
    command = [sys.executable, "-X", "importtime", "-m", "dflash_queue", "run", str(SAMPLE), "-c", str(config)]
    with RunLock(tmp_path / "state", "test"):  # a first run holds the state directory
        refused = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO)
    message = "\n".join(line for line in refused.stderr.splitlines() if not line.startswith("import time:"))
    assert refused.returncode == 1, message[-3000:]
    assert f"in use by `dflash-queue run` pid {os.getpid()} on " in message, message[-3000:]
    imported = imported_modules(refused.stderr)
    assert "dflash_queue" in imported  # the import trace was read
    assert imported & HEAVY == set(), sorted(imported & HEAVY)
    assert not (tmp_path / "state" / "redis").exists()  # no private broker started
