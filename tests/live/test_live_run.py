"""A trainer consuming a run while it extracts: real workers, Redis, the tiny model; storage bounded by the window."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from rich.console import Console

from dflash_queue.ops.status import WorkerView, collect_status
from dflash_queue.ops.status_view import status_table
from dflash_queue.producer import Producer
from dflash_queue.queue.app import configure_app
from dflash_queue.runstate.ledger import Ledger
from dflash_queue.runstate.window import ShardWindow
from dflash_queue.storage import open_storage
from dflash_queue.verify import verify
from dfq_testing.jobs import dataset_ids, first_lines
from dfq_testing.live_ranks import stored_training_files, train_two_ranks
from dfq_testing.polling import wait_until
from dfq_testing.s3 import free_port

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "examples" / "sharegpt_sample.jsonl"
pytestmark = pytest.mark.slow

WINDOW = 2


def live_config(make_config, **overrides):
    storage = {"retention": "until-consumed", **overrides.pop("storage", {})}
    return make_config(
        dataset={"shard_size": 4, "thinking": "never"},
        generate__sampling={"max_tokens": 8},
        extract={"max_unconsumed_shards": WINDOW},
        storage=storage,
        **overrides,
    )


def test_two_ranks_train_while_it_extracts_two_epochs_within_the_window(make_config, redis_url, start_worker, tmp_path):
    config = live_config(make_config)
    configure_app(config)
    dataset = first_lines(SAMPLE, 22, tmp_path / "prompts.jsonl")  # 6 shards, the last of 2 samples
    workers = [start_worker(config, "generate"), start_worker(config, "extract")]
    report = Producer(config, Ledger.from_url(redis_url, config.run.name)).enqueue([dataset])
    assert report.enqueued == 6
    storage_root = Path(config.storage.url)

    # Fails well within pytest's timeout, with the window, the ranks and the queues shown, if the ranks stall.
    result = train_two_ranks(config, deadline_s=420, logs=lambda: "\n".join(w.log_tail() for w in workers))
    assert not result.errors, result.errors
    seen, shards_per_rank, fills = result.seen, result.shards_per_rank, result.fills

    expected = dataset_ids(dataset)
    for epoch in (0, 1):
        assert set(seen[epoch]) == expected and set(seen[epoch].values()) == {1}, epoch
        assert shards_per_rank[0][epoch] == shards_per_rank[1][epoch] == 3
    assert max(fills) <= WINDOW, fills
    # Every shard was consumed by the only consumer and deleted, its samples recorded.
    assert stored_training_files(storage_root) == []
    assert len(list((storage_root / "consumed" / "0").glob("*.json"))) == 6
    assert len(list((storage_root / "consumed" / "1").glob("*.json"))) == 6
    assert len(list((storage_root / "completions").glob("*.jsonl"))) == 6
    consumption = ShardWindow.from_url(redis_url, config.run.name)
    assert consumption.window_fill() == 0


def start_trainer(config, log_path: Path, ack_log: Path, *, epochs: int = 2, extra: tuple[str, ...] = (), torchrun: int = 0):
    command = [str(REPO / "examples" / "train_online.py"), "-c", str(config.source), "--epochs", str(epochs),
               "--ack-log", str(ack_log), *extra]
    if torchrun:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(torchrun),
                    "--master-port", str(free_port())]
    else:
        launcher = [sys.executable]
    log = log_path.open("a")
    return subprocess.Popen([*launcher, *command], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def acks_per_epoch(ack_log: Path) -> dict[int, Counter[str]]:
    acks: dict[int, Counter[str]] = {}
    for line in ack_log.read_text().splitlines():
        entry = json.loads(line)
        acks.setdefault(entry["epoch"], Counter()).update(entry["samples"])
    return acks


class StorageWatch(threading.Thread):
    """The most training files storage held at once, looked at every 50 ms."""

    def __init__(self, count) -> None:
        super().__init__(daemon=True)
        self.count, self.most, self.stopped = count, 0, threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(0.05):
            self.most = max(self.most, self.count())


def test_no_consumer_waits_then_a_trainer_killed_with_an_extract_worker_loses_and_duplicates_nothing(
    make_config, redis_url, start_worker, tmp_path
):
    config = live_config(make_config, broker={"visibility_timeout_s": 12, "task_timeout_s": 10})
    configure_app(config)
    dataset = first_lines(SAMPLE, 22, tmp_path / "prompts.jsonl")
    storage_root = Path(config.storage.url)
    watch = StorageWatch(lambda: len(stored_training_files(storage_root)))
    watch.start()
    generate = start_worker(config, "generate")
    extract = start_worker(config, "extract")
    Producer(config, Ledger.from_url(redis_url, config.run.name)).enqueue([dataset])

    # No consumer: the window fills, extraction waits, and status says why.
    def waiting():
        status = collect_status(config, workers=WorkerView())
        return status if status.live and status.live.waiting else None

    status = wait_until(waiting, 120, "extraction waiting on the window", [generate, extract])
    console = Console(width=200, record=True)
    console.print(status_table(status))
    shown = console.export_text()
    assert f"window: {WINDOW} of {WINDOW} shards unconsumed" in shown and "no consumer is registered" in shown, shown
    time.sleep(3)
    assert len(stored_training_files(storage_root)) == WINDOW

    # A trainer (a DataLoader worker reads the shards) killed mid-epoch, and the extract worker with it.
    ack_log = tmp_path / "acks.jsonl"
    trainer_log = tmp_path / "trainer.log"
    trainer = start_trainer(config, trainer_log, ack_log, extra=("--num-workers", "1", "--step-delay", "0.3"))
    wait_until(lambda: ack_log.exists() and len(ack_log.read_text().splitlines()) >= 2, 180, "two shards acknowledged",
               [generate, extract])
    os.killpg(trainer.pid, signal.SIGKILL)
    trainer.wait()
    extract.kill()
    extract = start_worker(config, "extract")
    trainer = start_trainer(config, trainer_log, ack_log, extra=("--num-workers", "1"))
    trainer.wait(timeout=300)
    assert trainer.returncode == 0, trainer_log.read_text()[-3000:]
    watch.stopped.set()

    acks = acks_per_epoch(ack_log)
    for epoch in (0, 1):
        report = verify(config, [dataset], epoch=epoch)
        assert report.ok, report.lines()
        assert report.consumed == report.done > 0
        assert set(acks[epoch].values()) == {1} and sum(acks[epoch].values()) == report.done, epoch
    assert watch.most <= WINDOW
    assert stored_training_files(storage_root) == []


def test_torchrun_ranks_train_on_a_live_run_in_s3(make_config, redis_url, start_worker, tmp_path, s3_tables):
    config = live_config(make_config, storage=s3_tables["storage"], storage__s3=s3_tables["storage.s3"])
    configure_app(config)
    dataset = first_lines(SAMPLE, 22, tmp_path / "prompts.jsonl")
    workers = [start_worker(config, "generate"), start_worker(config, "extract")]
    Producer(config, Ledger.from_url(redis_url, config.run.name)).enqueue([dataset])
    ack_log = tmp_path / "acks.jsonl"
    trainer_log = tmp_path / "trainer.log"
    trainer = start_trainer(config, trainer_log, ack_log, torchrun=2, extra=("--num-workers", "0"))
    assert trainer.wait(timeout=400) == 0, trainer_log.read_text()[-3000:] + workers[1].log_tail()

    acks = acks_per_epoch(ack_log)
    ranks = Counter((json.loads(line)["rank"], json.loads(line)["epoch"]) for line in ack_log.read_text().splitlines())
    assert ranks == {(0, 0): 3, (1, 0): 3, (0, 1): 3, (1, 1): 3}
    storage = open_storage(config.storage)
    assert not [k for k in storage.list("") if k.endswith(".safetensors")]
    for epoch in (0, 1):
        report = verify(config, [dataset], epoch=epoch)
        assert report.ok and report.consumed == report.done == sum(acks[epoch].values()), report.lines()
        assert set(acks[epoch].values()) == {1}
