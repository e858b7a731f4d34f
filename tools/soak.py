#!/usr/bin/env python
"""Chaos soak: a job on real parts while a seeded scheduler injects faults, then every invariant checked.

The job: the tiny model, `--shards` shards of `--shard-size` synthetic prompts enqueued in waves (one every 10 s or
so over the first three quarters of the window, so that faults meet work in flight), `--workers` generate and
`--workers` extract workers, a private redis-server (AOF on), local storage or an S3 endpoint of its own (moto, in a
process of its own). For `--duration` seconds faults arrive at random (exponential gaps, mean `--mean-gap-s`):

  kill-worker    SIGKILL of a random worker, restarted after 1-5 s (as the OOM killer, a node lost)
  term-worker    SIGTERM of a random worker (warm shutdown), restarted after 1-5 s
  kill-broker    SIGKILL of redis-server, restarted from its AOF after 1-3 s
  stall-broker   SIGSTOP of redis-server for 2-6 s, then SIGCONT (stalled connections)
  storage-down   the S3 endpoint stopped (SIGSTOP) for 2-6 s, or the local root made read-only for 2-6 s

When it ends, or is stopped (SIGTERM, Ctrl-C), it stops every process it started, restarted workers and those
they replaced included: SIGTERM, then SIGKILL after 30 s, the broker last.

`--seed` fixes the schedule (the same seed, the same faults at the same times). After the window every fault is
healed and the job runs to its end; a job that makes no progress for `--stall-s` while shards are left gets the
documented recovery (`enqueue --rebuild`: storage decides what is done), which the report counts.

Checked at the end (exit 1 if any fails): `verify` (every sample exactly once: none missing, none duplicated); no
temporary file left in storage or a staging directory, no incomplete multipart upload; the ledger's done shards
equal the stored shards; every dead letter names its error. Printed: each fault with its time and the time lost to
it (until a shard was next stored after the part came back), for each killed worker the time until its messages were
delivered again, the shards redone (their task delivered more than once), the recoveries.

    .venv/bin/python tools/soak.py --duration 1800 --shards 200 --seed 1 --storage s3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dflash_queue.broker.redis_server import RedisServer  # noqa: E402
from dflash_queue.config import load_config  # noqa: E402
from dflash_queue.deadletters import DeadLetters  # noqa: E402
from dflash_queue.faults import ENV  # noqa: E402
from dflash_queue.producer import Producer  # noqa: E402
from dflash_queue.queue.app import configure_app  # noqa: E402
from dflash_queue.queue.launcher import WorkerProcess  # noqa: E402
from dflash_queue.queue.liveness import Liveness  # noqa: E402
from dflash_queue.runstate.ledger import DONE, FAILED, Ledger  # noqa: E402
from dflash_queue.shards.keys import stored_shard_ids  # noqa: E402
from dflash_queue.storage import open_storage  # noqa: E402
from dflash_queue.verify import verify  # noqa: E402
from dfq_testing.configs import tiny_config_tables, write_config  # noqa: E402
from dfq_testing.jobs import root_bypass_dropped  # noqa: E402
from dfq_testing.tiny_model import build_tiny_model  # noqa: E402

FAULTS = ("kill-worker", "term-worker", "kill-broker", "stall-broker", "storage-down")
# How long a process the soak started gets between SIGTERM and SIGKILL when the soak ends.
STOP_GRACE_S = 30.0


@dataclass
class Fault:
    at_s: float  # seconds after the window opened
    kind: str
    target: str = ""
    lasted_s: float = 0.0  # how long the part was down or stalled
    # kill-worker: seconds from the kill until every message the worker held was delivered again (None: not seen)
    redelivered_after_s: float | None = None
    held: list[str] = field(default_factory=list)
    # Time lost: seconds from the fault until the job next stored a shard after the part came back (None: no
    # shard stored after it, the job was done)
    healed_at_s: float = 0.0
    progress_after_s: float | None = None

    def line(self, final: bool = True) -> str:
        out = f"{self.at_s:7.1f} s  {self.kind:<13} {self.target:<28} down {self.lasted_s:4.1f} s"
        if self.progress_after_s is not None:
            out += f"  next shard stored {self.progress_after_s:5.1f} s after"
        if self.kind == "kill-worker":
            if not self.held:
                out += "  (held no message)"
            elif not final:
                out += f"  {len(self.held)} held"
            elif self.redelivered_after_s is None:
                out += f"  {len(self.held)} held, not seen delivered again (done by then, or after the run)"
            else:
                out += f"  {len(self.held)} held, delivered again after {self.redelivered_after_s:.1f} s"
        return out


def schedule(seed: int, duration_s: float, mean_gap_s: float) -> list[tuple[float, str, float, int]]:
    """(time, kind, down time, target draw) of every fault: the same for the same seed."""
    rng = random.Random(seed)
    faults, now = [], rng.expovariate(1 / mean_gap_s)
    while now < duration_s:
        kind = rng.choice(FAULTS)
        down = {"kill-broker": rng.uniform(1, 3), "stall-broker": rng.uniform(2, 6)}.get(kind, rng.uniform(2, 6))
        if kind in ("kill-worker", "term-worker"):
            down = rng.uniform(1, 5)
        faults.append((now, kind, down, rng.randrange(1 << 30)))
        now += rng.expovariate(1 / mean_gap_s)
    return faults


def write_waves(root: Path, shards: int, shard_size: int, waves: int, seed: int) -> list[Path]:
    """The prompts in `waves` files of whole shards (the first ones a shard more where they do not divide)."""
    rng = random.Random(seed)
    topics = ["sorting", "recursion", "a haiku", "prime numbers", "SQL joins", "the tides", "binary search", "Rust"]
    files, number = [], 0
    for wave in range(waves):
        path = root / f"prompts-{wave:03d}.jsonl"
        with path.open("w") as out:
            for _ in range((shards // waves + (wave < shards % waves)) * shard_size):
                prompt = f"Request {number}: explain {rng.choice(topics)} in {rng.randint(2, 9)} sentences."
                record = {"id": f"soak-{number}", "conversations": [{"from": "human", "value": prompt}]}
                out.write(json.dumps(record) + "\n")
                number += 1
        files.append(path)
    return files


class Job:
    def __init__(self, args: argparse.Namespace, root: Path) -> None:
        self.args = args
        self.root = root
        # Every process the soak starts, restarted workers and the enqueues included, so that none outlives it.
        self.started: list[WorkerProcess] = []
        self.enqueues: list[subprocess.Popen] = []
        self.redis = RedisServer(root / "redis", appendonly=True)
        self.s3 = None
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        args, root = self.args, self.root
        self.redis.start()
        model = args.model or build_tiny_model(root / "model")
        tables = tiny_config_tables(model, root / "storage", self.redis.url, root / "state")
        overrides: dict = {
            "run": {"name": "soak"},
            "broker": {"visibility_timeout_s": 600, "task_timeout_s": 300, "worker_liveness_s": 6, "max_deliveries": 6},
            "dataset": {"shard_size": args.shard_size, "thinking": "never"},
            "generate.sampling": {"max_tokens": args.max_tokens},
            "storage": {"unavailable_task_retries": 60},
        }
        if args.storage == "s3":
            from dfq_testing.s3 import LoopbackS3Process

            self.s3 = LoopbackS3Process().start()
            bucket = self.s3.create_bucket("soak")
            overrides["storage"]["url"] = f"s3://{bucket}/run"
            overrides["storage.s3"] = {"endpoint_url": self.s3.endpoint_url, "max_attempts": 3, "connect_timeout_s": 2.0,
                                      "read_timeout_s": 10.0}
            os.environ.update({"AWS_ACCESS_KEY_ID": "soak", "AWS_SECRET_ACCESS_KEY": "soak", "AWS_DEFAULT_REGION": "us-east-1"})
        self.config = load_config(write_config(root / "soak.toml", tables, **overrides))
        configure_app(self.config)
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        # --task-s: every task holds its worker that much longer (the test harness's task delay, through its
        # wrapper), as a real target's generation would, so that kills meet tasks in flight.
        self.worker_env = {**self.env, **({ENV: json.dumps({"task_delay_s": args.task_s})} if args.task_s else {})}
        # A read-only directory binds root only without its capabilities.
        self.prefix = tuple(root_bypass_dropped()) if args.storage == "local" else ()
        self.workers: dict[str, WorkerProcess] = {}
        self.starts: dict[str, int] = {}
        for lane in ("generate", "extract"):
            for n in range(args.workers):
                self.start_worker(f"{lane}-{n}")
        self.client = redis.Redis.from_url(self.redis.url, decode_responses=True, socket_timeout=5)
        self.ledger = Ledger(self.client, "soak")
        self.liveness = Liveness(self.client, "soak", self.config.broker.worker_liveness_s)

    def start_worker(self, name: str) -> None:
        """Each start is a node of its own: a worker still finishing its warm shutdown keeps its name."""
        lane = name.split("-")[0]
        self.starts[name] = self.starts.get(name, 0) + 1
        self.workers[name] = WorkerProcess(
            lane, Path(self.config.source), self.worker_env, self.root / "logs" / f"{name}.log",
            hostname=self.node(name), prefix=self.prefix,
            module="dfq_testing.faulty_worker" if self.args.task_s else "dflash_queue",
        )
        # The worker it replaces may still be finishing its warm shutdown: both are kept to be stopped.
        self.started.append(self.workers[name])

    def node(self, name: str) -> str:
        return f"{name}.{self.starts[name]}@soak"

    def held_by(self, name: str) -> list[str]:
        try:
            return [m.task_id for m in self.liveness.held() if m.node == self.node(name)]
        except redis.RedisError:
            return []

    def enqueue(self, wave: Path) -> subprocess.Popen:
        with (self.root / "logs" / "enqueue.log").open("a") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "dflash_queue", "enqueue", str(wave), "-c", str(self.config.source)],
                env=self.env, stdout=log, stderr=subprocess.STDOUT,
            )
        self.enqueues.append(process)
        return process

    def note_held(self, shards: dict[str, str]) -> None:
        """Which shard and lane each task the workers hold is for (task ids are not shard ids)."""
        try:
            shards.update({m.task_id: f"{m.queue} {m.shard_id}" for m in self.liveness.held()})
        except redis.RedisError:
            pass

    def deliveries(self) -> dict[str, int]:
        """Deliveries per task, its retries together; {} while the broker does not answer."""
        counts: dict[str, int] = {}
        try:
            for (task_id, _retries), count in self.ledger.deliveries().items():
                counts[task_id] = counts.get(task_id, 0) + count
        except redis.RedisError:
            pass
        return counts

    def storage_root(self) -> Path:
        return Path(self.config.storage.url)

    def stop_processes(self, grace_s: float = STOP_GRACE_S) -> None:
        """Every worker ever started (restarted ones and those they replaced) and every enqueue: SIGTERM (a warm
        shutdown), then SIGKILL of its process group for any still running after `grace_s` (a worker in warm
        shutdown retrying a broker that is gone ignores SIGTERM for minutes)."""
        workers = [w for w in self.started if w.alive()]
        enqueues = [p for p in self.enqueues if p.poll() is None]
        for worker in workers:
            worker.terminate()
        for process in enqueues:
            process.terminate()
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and (any(w.alive() for w in workers)
                                               or any(p.poll() is None for p in enqueues)):
            time.sleep(0.2)
        for worker in workers:
            if worker.alive():
                print(f"  {worker.hostname} (pid {worker.pid}) still running {grace_s:.0f} s after SIGTERM: killed",
                      flush=True)
            worker.stop(timeout=0.1)  # kills what is left, closes its log
        for process in enqueues:
            if process.poll() is None:
                process.kill()
            process.wait()

    def close(self) -> None:
        """Stop everything the soak started: the workers and enqueues first (they may still need the broker to
        finish), then the broker and the S3 endpoint."""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the cleanup short
        try:
            self.stop_processes()
        finally:
            self.redis.stop()
            if self.s3 is not None:
                self.s3.stop()


def inject(job: Job, fault: Fault, down_s: float, draw: int, heal_at: list[tuple[float, object]]) -> None:
    now = time.monotonic()
    fault.lasted_s = down_s
    fault.healed_at_s = fault.at_s + down_s
    if fault.kind in ("kill-worker", "term-worker"):
        alive = sorted(n for n, w in job.workers.items() if w.alive())
        if not alive:
            return
        name = alive[draw % len(alive)]
        fault.target = name
        worker = job.workers[name]
        if fault.kind == "kill-worker":
            counts = job.deliveries()
            fault.held = [f"{task}:{counts.get(task, 0)}" for task in job.held_by(name)]
            worker.kill()
        else:
            worker.terminate()
        heal_at.append((now + down_s, lambda: job.start_worker(name)))
    elif fault.kind == "kill-broker":
        # Faults overlap: a stalled broker can be killed, a dead one killed again; the first restart due brings it
        # back and the later ones find it running.
        fault.target = "redis-server" if job.redis.process is not None else "redis-server (already down)"
        if job.redis.process is not None:
            job.redis.stop(kill=True)
        heal_at.append((now + down_s, lambda: job.redis.process is None and job.redis.start()))
    elif fault.kind == "stall-broker":
        process = job.redis.process
        fault.target = "redis-server" if process is not None else "redis-server (down: nothing to stall)"
        if process is not None:
            process.send_signal(signal.SIGSTOP)
            heal_at.append((now + down_s, lambda: process.poll() is None and process.send_signal(signal.SIGCONT)))
    elif job.s3 is not None:
        fault.target = "S3 endpoint"
        job.s3.process.send_signal(signal.SIGSTOP)
        heal_at.append((now + down_s, lambda: job.s3.process.send_signal(signal.SIGCONT)))
    else:
        fault.target = "storage root read-only"
        root = job.storage_root()
        dirs = [root, *(p for p in root.iterdir() if p.is_dir())]
        for d in dirs:
            d.chmod(0o555)
        heal_at.append((now + down_s, lambda: [d.chmod(0o755) for d in dirs]))


def watch_redelivery(job: Job, faults: list[Fault], opened: float) -> None:
    for fault in faults:
        if fault.kind != "kill-worker" or not fault.held or fault.redelivered_after_s is not None:
            continue
        counts = job.deliveries()
        again = [counts.get(entry.rsplit(":", 1)[0], 0) > int(entry.rsplit(":", 1)[1]) for entry in fault.held]
        if all(again):
            fault.redelivered_after_s = time.monotonic() - opened - fault.at_s


def progress(job: Job) -> tuple[int, int]:
    try:
        states = job.ledger.states()
    except redis.RedisError:
        return -1, -1
    return sum(s == DONE for s in states.values()), sum(s == FAILED for s in states.values())


def check(job: Job, dataset: list[Path]) -> list[str]:
    problems = []
    report = verify(job.config, dataset)
    print("\n".join("  " + line for line in report.lines()[:12]))
    if not report.ok:
        problems.append(f"verify: {len(report.missing)} missing, {len(report.duplicated)} duplicated")
    storage = open_storage(job.config.storage)
    leftovers = [k for k in storage.list("") if k.rsplit("/", 1)[-1].startswith(".tmp-")]
    staging = job.root / "state" / "staging"
    leftovers += [str(p) for p in staging.rglob("*") if p.is_file()] if staging.exists() else []
    if job.s3 is not None:
        uploads = job.s3.client().list_multipart_uploads(Bucket="soak").get("Uploads", [])
        leftovers += [f"multipart upload {u['Key']}" for u in uploads]
    if leftovers:
        problems.append(f"left behind: {leftovers[:5]}")
    ledger = job.ledger
    done = {s for s, state in ledger.states().items() if state == DONE}
    stored = stored_shard_ids(storage)
    if done != stored:
        problems.append(f"ledger done {len(done)} != stored {len(stored)}: {sorted(done ^ stored)[:5]}")
    for record in DeadLetters(job.client, "soak").all():
        print(f"  dead letter: {record.summary()}")
        if not record.exc_type or not record.message:
            problems.append(f"dead letter {record.id} names no error")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds during which faults arrive")
    parser.add_argument("--shards", type=int, default=200)
    parser.add_argument("--shard-size", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=8, help="reply length: the work a task holds a worker for")
    parser.add_argument("--task-s", type=float, default=0.0, help="seconds each task holds its worker beyond its work "
                        "(a real target's pace; the tiny model takes ~0.1 s a shard)")
    parser.add_argument("--workers", type=int, default=2, help="workers per lane")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--mean-gap-s", type=float, default=8.0)
    parser.add_argument("--storage", choices=("local", "s3"), default="local")
    parser.add_argument("--stall-s", type=float, default=60.0)
    parser.add_argument("--timeout", type=float, default=1800.0, help="give up waiting for the job after this")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--model", type=Path, default=None,
                        help="a tiny model built before (dfq_testing.tiny_model); default: built in the workdir")
    args = parser.parse_args()
    # Stopped from outside (a CI job cancelled, `kill`): unwind, so that everything started is stopped too.
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))

    planned = schedule(args.seed, args.duration, args.mean_gap_s)
    root = args.workdir or Path(tempfile.mkdtemp(prefix="dfq-soak-"))
    print(f"soak: seed {args.seed}, {len(planned)} faults over {args.duration:.0f} s, {args.shards} shards, "
          f"storage {args.storage}, work in {root}", flush=True)
    job = Job(args, root)
    recoveries = 0
    try:
        for worker in job.workers.values():
            worker.wait_ready(configure_app(job.config), timeout=300)
        # The job arrives in waves over the first part of the window, so faults meet work in flight (a tiny model
        # would otherwise finish a whole backlog before the first fault), and an enqueue meets faults too.
        # A wave every 10 s or so: each is an enqueue process of its own, which takes seconds to start on a busy
        # machine, and one runs at a time (at one every 3 s they fell behind and a quarter were never enqueued).
        waves = write_waves(root, args.shards, args.shard_size, max(1, min(args.shards, int(args.duration / 10))),
                            args.seed)
        wave_gap_s = args.duration * 0.75 / len(waves)
        enqueued: list[Path] = []
        enqueuing: subprocess.Popen | None = None  # the producer is a process of its own, as an operator's is
        opened = time.monotonic()
        faults: list[Fault] = []
        heal_at: list[tuple[float, object]] = []
        stored_at: list[float] = []  # when the done count went up, seconds after the window opened
        task_shards: dict[str, str] = {}
        most_done = 0
        last_progress, last_done = time.monotonic(), -1
        while True:
            now = time.monotonic()
            while planned and opened + planned[0][0] <= now:
                at, kind, down, draw = planned.pop(0)
                fault = Fault(at, kind)
                inject(job, fault, down, draw, heal_at)
                faults.append(fault)
                print(fault.line(final=False), flush=True)
            for when, heal in [h for h in heal_at if h[0] <= now]:
                heal_at.remove((when, heal))
                heal()  # type: ignore[operator]
            if enqueuing is not None and enqueuing.poll() is not None:
                wave = waves[len(enqueued)]
                if enqueuing.returncode == 0:
                    enqueued.append(wave)
                else:
                    print(f"  enqueue {wave.name} exited with {enqueuing.returncode}; again", flush=True)
                enqueuing = None
            if enqueuing is None and len(enqueued) < len(waves) and now >= opened + len(enqueued) * wave_gap_s:
                enqueuing = job.enqueue(waves[len(enqueued)])
            watch_redelivery(job, faults, opened)
            job.note_held(task_shards)
            done, failed = progress(job)
            if done > most_done:
                stored_at.append(now - opened)
                most_done = done
            if done >= 0 and done + failed == args.shards and not planned and not heal_at:
                break
            if done != last_done:
                last_progress, last_done = now, done
            elif not planned and not heal_at and len(enqueued) == len(waves) and now - last_progress > args.stall_s:
                recoveries += 1
                print(f"no progress for {args.stall_s:.0f} s with {args.shards - done - failed} shards left: "
                      "enqueue --rebuild", flush=True)
                Producer(job.config, Ledger.from_url(job.redis.url, "soak")).enqueue(waves, rebuild=True)
                last_progress = now
            if now - opened > args.timeout:
                print("timed out waiting for the job", flush=True)
                break
            time.sleep(0.2)
        elapsed = time.monotonic() - opened
        time.sleep(2)  # the last acknowledgements
        job.stop_processes(grace_s=60)  # nothing may change storage or the ledger while they are compared
        print(f"\njob finished after {elapsed:.0f} s: {done} shards done, {failed} failed; {len(faults)} faults; "
              f"{recoveries} recoveries (enqueue --rebuild)")
        for fault in faults:
            fault.progress_after_s = next((t - fault.at_s for t in stored_at if t >= fault.healed_at_s), None)
            print("  " + fault.line())
        redelivered = [f.redelivered_after_s for f in faults if f.redelivered_after_s is not None]
        if redelivered:
            print(f"killed workers' messages delivered again after {min(redelivered):.1f}-{max(redelivered):.1f} s")
        again = [task_id for (task_id, _retries), count in job.ledger.deliveries().items() if count > 1]
        redone = sorted({task_shards.get(task_id, f"task {task_id}") for task_id in again})
        print(f"tasks delivered more than once: {len(again)}; shards redone: {len(redone)}"
              + (f" ({', '.join(redone)})" if redone else ""))
        problems = check(job, waves)
    finally:
        job.close()
    for problem in problems:
        print(f"FAILED: {problem}")
    print("soak: OK" if not problems else "soak: FAILED")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
