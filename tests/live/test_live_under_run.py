"""Training while it extracts under `dflash-queue run`, as docs/live-training.md says: the run (its own private
broker, broker.url empty) and the example trainer started beside it, to the trainer's last epoch."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from dflash_queue.broker.run_broker import private_broker_dir
from dflash_queue.config import load_config
from dflash_queue.live import LiveShards
from dfq_testing.commands import dflash_queue
from dfq_testing.configs import tiny_config_tables, write_config
from dfq_testing.jobs import dataset_ids, first_lines

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "examples" / "sharegpt_sample.jsonl"
pytestmark = pytest.mark.slow


def run_config(tiny_model: Path, tmp_path: Path) -> Path:
    tables = tiny_config_tables(tiny_model, tmp_path / "out", "", tmp_path / "state")
    return write_config(
        tmp_path / "run.toml",
        tables,
        dataset={"shard_size": 4, "thinking": "never"},
        **{"generate.sampling": {"max_tokens": 8}},
        extract={"max_unconsumed_shards": 2},
        storage={"retention": "until-consumed"},
    )


def test_a_trainer_with_an_empty_broker_url_and_no_run_says_to_start_one(tiny_model, tmp_path):
    config = load_config(run_config(tiny_model, tmp_path))
    with pytest.raises(Exception, match="no `dflash-queue run` of this job is running") as caught:
        LiveShards(config, consumer="drafter", run_wait_s=0)
    assert "Redis URL must specify" not in str(caught.value)


def test_the_example_trains_two_epochs_on_a_job_dflash_queue_run_runs(tiny_model, tmp_path):
    config_path = run_config(tiny_model, tmp_path)
    dataset = first_lines(SAMPLE, 10, tmp_path / "prompts.jsonl")  # 3 shards, the last of 2 samples
    run = subprocess.Popen(
        [sys.executable, "-m", "dflash_queue", "run", str(dataset), "-c", str(config_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    ack_log = tmp_path / "acks.jsonl"
    # The documented command, started beside the run: it finds the run's broker.
    trainer = subprocess.run(
        [sys.executable, str(REPO / "examples" / "train_online.py"), "-c", str(config_path), "--epochs", "2",
         "--num-workers", "1", "--ack-log", str(ack_log)],
        capture_output=True, text=True, timeout=600,
    )
    try:
        out, err = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
    assert trainer.returncode == 0, trainer.stdout[-3000:] + trainer.stderr[-3000:] + run.stderr.read()[-3000:]
    assert "2 epoch(s)" in trainer.stdout
    assert run.returncode == 0, err[-3000:]
    assert "staying up for training" in err and "every consumer has trained its epochs" in err, err[-3000:]
    assert not (private_broker_dir(load_config(config_path).run) / "broker.url").exists()  # the run stopped its broker

    acks: dict[int, Counter[str]] = {}
    for line in ack_log.read_text().splitlines():
        entry = json.loads(line)
        acks.setdefault(entry["epoch"], Counter()).update(entry["samples"])
    expected = dataset_ids(dataset)
    assert sorted(acks) == [0, 1]
    for epoch in (0, 1):
        assert set(acks[epoch]) <= expected and set(acks[epoch].values()) == {1}, epoch
        # verify reads the stopped run's broker from its data: every sample accounted for, in each epoch.
        checked = dflash_queue("verify", dataset, "-c", config_path, "--epoch", epoch, timeout=120)
        assert checked.returncode == 0, checked.stdout + checked.stderr
