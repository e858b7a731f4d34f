"""Fault injection exists for the test suite only: a worker or a run started the ordinary way with
DFQ_INJECT_FAULTS in its environment refuses to start, saying why; the harness's wrapper installs the faults."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from dflash_queue import faults

REPO = Path(__file__).resolve().parents[2]


def test_a_production_worker_refuses_to_start_with_faults_in_its_environment(make_config):
    config = make_config()
    env = {**os.environ, faults.ENV: json.dumps({"extract_break_packing": True})}
    done = subprocess.run(
        [sys.executable, "-m", "dflash_queue", "worker", "extract", "-c", str(config.source)],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode != 0
    assert f"{faults.ENV} is set: fault injection exists for the test suite only" in done.stderr + done.stdout
    assert "loading the extract engine" not in done.stderr + done.stdout  # refused before any engine loads


def test_a_run_refuses_to_start_with_faults_in_its_environment(make_config, tmp_path):
    config = make_config(broker={"url": ""})
    env = {**os.environ, faults.ENV: json.dumps({"task_delay_s": 1})}
    done = subprocess.run(
        [sys.executable, "-m", "dflash_queue", "run", str(REPO / "examples" / "sharegpt_sample.jsonl"),
         "-c", str(config.source)],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode != 0 and "fault injection exists for the test suite only" in done.stderr
    assert not (tmp_path / "storage" / "prompts").exists()  # nothing staged


def test_the_harness_installs_the_faults_it_is_given(monkeypatch):
    monkeypatch.setenv(faults.ENV, json.dumps({"task_delay_s": 0.5, "extract_poison": ["a"]}))
    try:
        faults.install_from_environment()
        assert faults.installed() == {"task_delay_s": 0.5, "extract_poison": ["a"]}
        faults.refuse_uninstalled()  # installed: the harness's own worker starts
    finally:
        faults.uninstall()
    assert faults.installed() == {}
