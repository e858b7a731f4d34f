#!/usr/bin/env python
"""Stress of training while it extracts: the suite's two-rank test (two ranks of one consumer, two epochs, the
window at its smallest size, 2) run again and again with random delays in the trainer (per shard) and in the
workers (per task), and extract messages delivered twice (a redelivery after a worker was thought dead, a producer
that sent again), every one of which must come out as if delivered once.

Each repetition: a fresh run name on one redis-server, the tiny model, a generate and an extract worker, 6 shards;
then the ranks to their last epoch within `--deadline-s`, every sample served once per epoch, the window empty and
no training file left (retention = "until-consumed"). A repetition that stalls prints the window, the epochs, the
ranks and the queues. Not in the suite (minutes per ten repetitions):

    .venv/bin/python tools/stress_live.py --repetitions 20 --seed 1
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dflash_queue.broker.redis_server import RedisServer  # noqa: E402
from dflash_queue.config import load_config  # noqa: E402
from dflash_queue.faults import ENV  # noqa: E402
from dflash_queue.lanes.registry import FINAL_LANE  # noqa: E402
from dflash_queue.producer import Producer  # noqa: E402
from dflash_queue.queue.app import configure_app  # noqa: E402
from dflash_queue.queue.launcher import WorkerProcess  # noqa: E402
from dflash_queue.queue.tasks import send_to_lane  # noqa: E402
from dflash_queue.runstate.ledger import Ledger  # noqa: E402
from dflash_queue.runstate.shard_states import DONE, GENERATED  # noqa: E402
from dflash_queue.runstate.window import ShardWindow, epoch_states  # noqa: E402
from dfq_testing.configs import tiny_config_tables, write_config  # noqa: E402
from dfq_testing.jobs import dataset_ids, first_lines  # noqa: E402
from dfq_testing.live_ranks import random_delay, stored_training_files, train_two_ranks  # noqa: E402
from dfq_testing.tiny_model import build_tiny_model  # noqa: E402

SAMPLE = REPO / "examples" / "sharegpt_sample.jsonl"
WINDOW = 2


class Duplicator(threading.Thread):
    """Sends a shard's extract message again, now and then, for shards of the epoch being extracted whose message
    was sent: a message delivered twice."""

    def __init__(self, config, rng: random.Random, every_s: tuple[float, float]) -> None:
        super().__init__(daemon=True)
        self.config, self.rng, self.every_s = config, rng, every_s
        self.stopped = threading.Event()
        self.sent = 0

    def run(self) -> None:
        consumption = ShardWindow.from_url(self.config.broker.connection_url(), self.config.run.name)
        ledger = Ledger(consumption.client, self.config.run.name)
        fingerprint = self.config.fingerprint()
        while not self.stopped.wait(self.rng.uniform(*self.every_s)):
            epoch = consumption.last_epoch()
            shards = consumption.epoch_shards(epoch) or {}
            # Only shards whose extract message was sent (generated, or extracted already): a second delivery.
            states = epoch_states(consumption, ledger, epoch, list(shards))
            # Shards still waiting for extraction first: their second delivery races the first through the window.
            waiting = sorted(s for s, state in states.items() if state == GENERATED)
            sent = waiting or sorted(s for s, state in states.items() if state == DONE)
            if sent:
                shard_id = self.rng.choice(sent)
                send_to_lane(FINAL_LANE.name, shard_id, shards[shard_id], fingerprint, epoch=epoch)
                self.sent += 1


def repetition(number: int, root: Path, model: Path, broker_url: str, args, rng: random.Random) -> dict:
    work = root / f"rep{number}"
    work.mkdir(parents=True)
    tables = tiny_config_tables(model, work / "storage", broker_url, work / "state")
    tables["run"]["name"] = f"stress-{number}"
    config = load_config(write_config(
        work / "config.toml", tables,
        dataset={"shard_size": 4, "thinking": "never"},
        **{"generate.sampling": {"max_tokens": 8}},
        extract={"max_unconsumed_shards": WINDOW},
        storage={"retention": "until-consumed"},
    ))
    app = configure_app(config)
    dataset = first_lines(SAMPLE, 22, work / "prompts.jsonl")  # 6 shards
    env = {**os.environ, ENV: json.dumps({"task_delay_s": [0.0, args.worker_delay_s]})}
    workers = [
        WorkerProcess(lane, Path(config.source), env, work / "logs" / f"{lane}.log", hostname=f"{lane}-{number}@stress",
                      module="dfq_testing.faulty_worker")
        for lane in ("generate", "extract")
    ]
    duplicator = Duplicator(config, rng, (0.5, args.duplicate_every_s))
    started = time.monotonic()
    try:
        for worker in workers:
            worker.wait_ready(app, timeout=180)
        Producer(config, Ledger.from_url(broker_url, config.run.name)).enqueue([dataset])
        if args.duplicate_every_s > 0:
            duplicator.start()
        result = train_two_ranks(
            config, deadline_s=args.deadline_s, delay_s=random_delay(0.0, args.trainer_delay_s, rng),
            logs=lambda: "\n".join(f"--- {w.lane}\n{w.log_tail()}" for w in workers),
        )
    finally:
        duplicator.stopped.set()
        for worker in workers:
            worker.terminate()
        for worker in workers:
            worker.stop(timeout=30)
    problems = [repr(e) for e in result.errors]
    expected = dataset_ids(dataset)
    for epoch in (0, 1):
        if set(result.seen[epoch]) != expected or set(result.seen[epoch].values()) != {1}:
            problems.append(f"epoch {epoch}: served {dict(result.seen[epoch])}")
    fill = ShardWindow.from_url(broker_url, config.run.name).window_fill()
    if fill:
        problems.append(f"window holds {fill} places after the last epoch")
    left = stored_training_files(Path(config.storage.url))
    if left:
        problems.append(f"training files left: {[str(p) for p in left]}")
    if max(result.fills, default=0) > WINDOW:
        problems.append(f"storage held {max(result.fills)} training files (window {WINDOW})")
    return {"repetition": number, "seconds": round(time.monotonic() - started, 1), "duplicates_sent": duplicator.sent,
            "problems": problems}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repetitions", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trainer-delay-s", type=float, default=0.5, help="A rank sleeps up to this per shard")
    parser.add_argument("--worker-delay-s", type=float, default=1.0, help="A task sleeps up to this first")
    parser.add_argument("--duplicate-every-s", type=float, default=3.0,
                        help="An extract message is sent again every 0.5 s to this (0: never)")
    parser.add_argument("--deadline-s", type=float, default=300.0)
    parser.add_argument("--model", type=Path, default=None, help="A tiny model already built")
    args = parser.parse_args()
    # Stopped (SIGTERM), it stops the workers and the broker it started, as on Ctrl-C.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rng = random.Random(args.seed)
    failed = 0
    with tempfile.TemporaryDirectory(prefix="dfq-stress-live-") as tmp:
        root = Path(tmp)
        model = args.model or build_tiny_model(root / "model")
        server = RedisServer(root / "redis").start()
        try:
            for number in range(args.repetitions):
                try:
                    outcome = repetition(number, root, model, server.url, args, rng)
                except AssertionError as exc:  # stalled: the state is in the message
                    outcome = {"repetition": number, "problems": [str(exc)]}
                failed += bool(outcome["problems"])
                print(json.dumps(outcome), flush=True)
        finally:
            server.stop()
    print(f"{args.repetitions - failed} of {args.repetitions} repetitions passed", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
