#!/usr/bin/env python
"""Queue overhead: what Redis, Celery and the workers add per shard, against the same two lanes handing shards to
each other directly.

The same jobs run two ways, in rounds that alternate which goes first, with the same overlap on both sides:

  pipeline: the producer stages and enqueues the job; a real generate worker and a real extract worker (engines
            loaded before timing) run it; timed from the start of enqueue until the ledger shows every shard done;
  direct:   the same two lanes in two processes (each started, like a worker, in a session of its own, running
            as many task threads as the lane's worker would), on storage of their own: the generate process
            writes each shard's prompt file, generates it and writes its id down a pipe; the extract process
            extracts each id as it arrives. Timed from the first prompt file written to the last shard stored.

Both ways generate shard i + 1 while shard i is extracted, so their difference is what the queue costs, not the
overlap. (Comparing with one process running the lanes shard after shard, as this benchmark once did, credited
the queue with the overlap: the pipeline came out faster than "no queue".)

Each round has a job of its own (the same prompts with a round tag, so new shards), so both ways do fresh work
every time with the same resident engines. Torch runs `--torch-threads` threads in every process (default 1):
on a shared two-core machine more threads than free cores make torch's thread pool spin, which slowed one
shard's generation 10-30x in measurements and drowned what is being measured here.

Prints per round the load average, both times, their ratio and (pipeline - direct) / shards in ms (target
<= 50), then min / median / max over the rounds, then the pipeline's time per shard by phase, from Celery's task
events and the lanes' busy-time counters:

  staging        enqueue start -> first generate task started (reading, length filter, prompt files, send)
  generate/extract lane      the lane's own work (its busy time), against the direct processes'
  generate/extract task      the rest of each task: delivery count, ledger writes, dead-letter settle, chain
  generate/extract dispatch  a worker idle while a message for it waited (broker -> worker -> pool thread)
  finish         last task finished -> the waiting loop saw every shard done

    .venv/bin/python tools/bench_pipeline.py [--samples 256] [--shard-size 8] [--rounds 5]
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dflash_queue.broker.redis_server import RedisServer  # noqa: E402
from dflash_queue.config import Config, load_config  # noqa: E402
from dflash_queue.data.readers import read_dataset  # noqa: E402
from dflash_queue.data.samples import Sample  # noqa: E402
from dflash_queue.lanes.extract import ExtractLane, build_extractor, extract_lane_settings  # noqa: E402
from dflash_queue.lanes.generate import GenerateLane, build_generate_engine, generate_lane_settings  # noqa: E402
from dflash_queue.lanes.registry import EXTRACT, GENERATE  # noqa: E402
from dflash_queue.producer import Producer  # noqa: E402
from dflash_queue.queue.app import configure_app  # noqa: E402
from dflash_queue.queue.busy import BusyClock  # noqa: E402
from dflash_queue.queue.launcher import WorkerProcess  # noqa: E402
from dflash_queue.runstate.ledger import DONE, Ledger  # noqa: E402
from dflash_queue.shards.keys import prompts_key  # noqa: E402
from dflash_queue.shards.prompts import encode_prompts, prompt_shard_id  # noqa: E402
from dflash_queue.storage import open_storage  # noqa: E402
from dfq_testing.configs import tiny_config_tables, write_config  # noqa: E402
from dfq_testing.polling import wait_for_states  # noqa: E402
from dfq_testing.tiny_model import build_tiny_model  # noqa: E402

LANE_OF = {GENERATE.task_name: "generate", EXTRACT.task_name: "extract"}


def make_dataset(count: int, out: Path, tag: str = "") -> Path:
    """`count` distinct prompts from the example files (numbered variants once they run out); a `tag` is appended
    to every first user turn, so each tag makes other samples (and shards) from the same prompts."""
    rows = []
    for path in sorted((REPO / "examples").glob("*.jsonl")):
        rows.extend(json.loads(line) for line in path.read_text().splitlines() if line.strip())
    lines = []
    for index in range(count):
        row = json.loads(json.dumps(rows[index % len(rows)]))
        suffix = (f" (variant {index // len(rows)})" if index >= len(rows) else "") + (f" ({tag})" if tag else "")
        if suffix:
            turns = row.get("conversations") or row["messages"]
            key = "value" if "conversations" in row else "content"
            first_user = next(t for t in turns if t.get("from", t.get("role")) in ("human", "user"))
            first_user[key] += suffix
        lines.append(json.dumps(row))
    out.write_text("\n".join(lines) + "\n")
    return out


def load_average() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


@dataclass
class TaskTimes:
    lane: str
    shard_id: str
    sent: float | None = None
    started: float | None = None
    succeeded: float | None = None
    runtime: float | None = None


class TaskEvents:
    """Celery's task events (sent, started, succeeded) collected in a thread, keyed by task id."""

    def __init__(self, app) -> None:
        self.app = app
        self.tasks: dict[str, TaskTimes] = {}
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._receiver = None
        self._thread = threading.Thread(target=self._run, name="bench-events", daemon=True)

    def __enter__(self) -> TaskEvents:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the event receiver did not start")
        return self

    def __exit__(self, *exc) -> None:
        if self._receiver is not None:
            self._receiver.should_stop = True
        self._thread.join(timeout=10)

    def _run(self) -> None:
        with self.app.connection_for_read() as connection:
            self._receiver = self.app.events.Receiver(connection, handlers={"*": self._on_event})
            consumer = self._receiver.consume(limit=None, timeout=None, wakeup=False)
            self._ready.set()
            for _ in consumer:
                pass

    def _on_event(self, event: dict) -> None:
        kind = event.get("type", "")
        if not kind.startswith("task-"):
            return
        with self._lock:
            if kind == "task-sent":
                lane = LANE_OF.get(event.get("name", ""))
                if lane is None:
                    return
                shard_id = ast.literal_eval(event["args"])[0]
                times = self.tasks.setdefault(event["uuid"], TaskTimes(lane, shard_id))
                times.sent = event["timestamp"]
            elif event.get("uuid") in self.tasks:
                times = self.tasks[event["uuid"]]
                if kind == "task-started":
                    times.started = event["timestamp"]
                elif kind == "task-succeeded":
                    times.succeeded = event["timestamp"]
                    times.runtime = event.get("runtime")

    def of(self, shard_ids: set[str], timeout: float = 10.0) -> dict[str, list[TaskTimes]]:
        """Each lane's tasks for these shards, in start order, once every one has its succeeded event."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                tasks = [t for t in self.tasks.values() if t.shard_id in shard_ids]
            complete = [t for t in tasks if None not in (t.sent, t.started, t.succeeded, t.runtime)]
            if len(complete) >= 2 * len(shard_ids) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        lanes: dict[str, list[TaskTimes]] = {"generate": [], "extract": []}
        for task in sorted(complete, key=lambda t: t.started):
            lanes[task.lane].append(task)
        missing = 2 * len(shard_ids) - len(complete)
        if missing:
            print(f"  ({missing} of {2 * len(shard_ids)} tasks lack an event; their phases are left out)", flush=True)
        return lanes


def dispatch_gaps(tasks: list[TaskTimes]) -> float:
    """Seconds a lane's worker sat idle while a message for it waited: each task's start minus the later of
    its sending and the previous task's end (one task at a time)."""
    gaps, free_at = 0.0, float("-inf")
    for task in tasks:
        gaps += task.started - max(task.sent, free_at)
        free_at = task.succeeded
    return gaps


@dataclass
class Round:
    load_before: float
    pipeline_s: float
    direct_s: float
    shards: int
    phases: dict[str, float] = field(default_factory=dict)  # seconds, whole job

    @property
    def overhead_ms(self) -> float:
        return 1000 * (self.pipeline_s - self.direct_s) / self.shards

    @property
    def ratio(self) -> float:
        return self.pipeline_s / self.direct_s


def spread(values: list[float]) -> tuple[float, float, float]:
    return min(values), statistics.median(values), max(values)


class Pipeline:
    """Two real workers, ready; runs one job at a time through the producer and times it."""

    def __init__(self, config: Config, env: dict[str, str], logs: Path) -> None:
        self.config = config
        self.app = configure_app(config)
        self.ledger = Ledger.from_url(config.broker.connection_url(), config.run.name)
        self.workers = [
            WorkerProcess(lane, Path(config.source), env, logs / f"{lane}.log", hostname=f"{lane}@bench")
            for lane in ("generate", "extract")
        ]
        self.events = TaskEvents(self.app)

    def __enter__(self) -> Pipeline:
        try:
            for worker in self.workers:
                worker.wait_ready(self.app, timeout=300)
            self.events.__enter__()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.events.__exit__()
        for worker in self.workers:
            worker.stop()

    def run(self, dataset: Path) -> tuple[float, list[str], dict[str, float]]:
        busy_before = self.ledger.counters()
        self.timeline: list[dict] = []
        started_wall, started = time.time(), time.perf_counter()
        report = Producer(self.config, self.ledger).enqueue([dataset])
        wait_for_states(self.ledger, report.shard_ids, {DONE}, timeout=1800, workers=self.workers, poll_s=0.005)
        elapsed = time.perf_counter() - started
        seen_wall = started_wall + elapsed
        busy = {k: v - busy_before.get(k, 0) for k, v in self.ledger.counters().items()}
        lanes = self.events.of(set(report.shard_ids))
        phases = {"staging": min(t.started for t in lanes["generate"]) - started_wall}
        shards = len(report.shard_ids)
        for lane, tasks in lanes.items():
            lane_s = busy[f"{lane}_busy_ms"] / 1000
            phases[f"{lane} lane"] = lane_s
            # Scaled up to every shard where a task's events were lost.
            share = len(tasks) / shards
            phases[f"{lane} task"] = (sum(t.runtime for t in tasks) - lane_s * share) / share
            phases[f"{lane} dispatch"] = dispatch_gaps(tasks) / share
        phases["finish"] = seen_wall - max(t.succeeded for t in lanes["extract"])
        self.timeline = [
            {"lane": lane, "shard": t.shard_id}
            | {k: round(getattr(t, k) - started_wall, 4) for k in ("sent", "started", "succeeded")}
            for lane, tasks in lanes.items()
            for t in tasks
        ]
        return elapsed, report.shard_ids, phases


def now() -> float:
    """CLOCK_MONOTONIC: one clock for every process on the machine, so that one process's start and another's end
    make one interval."""
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def work_through(
    take: Callable[[], str | None], run: Callable[[str], object], slots: int, hand_over: Callable[[str], None]
) -> float:
    """Run each item `take()` gives, until it gives None, in `slots` threads (as a worker's threads pool runs its
    tasks), handing each item on as soon as its run returns. Returns the seconds at least one item ran
    (overlapping runs counted once, as the workers' busy counters count them)."""
    clock, lock, done = BusyClock(), threading.Lock(), threading.Event()
    busy, errors = 0.0, []

    def loop() -> None:
        nonlocal busy
        while not done.is_set():
            with lock:
                item = None if done.is_set() else take()
                if item is None:
                    done.set()
                    return
            clock.start()
            try:
                run(item)
            except BaseException as exc:
                errors.append(exc)
                done.set()
                return
            finally:
                elapsed = clock.stop()
            with lock:
                busy += elapsed
                hand_over(item)

    threads = [threading.Thread(target=loop, name=f"bench-slot-{i}") for i in range(slots)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return busy


class DirectGenerate:
    """The generate lane in a process of its own: a job's shards, one prompt file each, generated and their ids
    written down the hand-over pipe as each is done, then an empty line."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.storage = open_storage(config.storage.url)
        self.lane = GenerateLane(generate_lane_settings(config), build_generate_engine(config), self.storage)

    def run(self, dataset: Path, pipe: TextIO) -> dict:
        samples = [s for s in read_dataset([dataset], max_record_bytes=1 << 20) if isinstance(s, Sample)]
        size = self.config.dataset.shard_size
        shards = iter([samples[begin : begin + size] for begin in range(0, len(samples), size)])
        shard_ids: list[str] = []

        def take() -> str | None:
            shard = next(shards, None)
            if shard is None:
                return None
            shard_id = prompt_shard_id(shard)
            self.storage.write_bytes(prompts_key(shard_id), encode_prompts(shard))
            shard_ids.append(shard_id)
            return shard_id

        def hand_over(shard_id: str) -> None:
            pipe.write(shard_id + "\n")
            pipe.flush()

        started = now()
        busy = work_through(take, self.lane.run, GENERATE.default_slots(self.config), hand_over)
        pipe.write("\n")
        pipe.flush()
        return {"started": started, "shard_ids": shard_ids, "busy": busy}

    def close(self) -> None:
        self.lane.close()


class DirectExtract:
    """The extract lane in a process of its own: each shard id read from the hand-over pipe, extracted and stored,
    until the empty line that ends a job."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.storage = open_storage(config.storage.url)
        self.lane = ExtractLane(extract_lane_settings(config), build_extractor(config), self.storage)

    def run(self, _dataset: Path, pipe: TextIO) -> dict:
        def take() -> str | None:
            line = pipe.readline()
            if not line:
                raise RuntimeError("the generate process closed the hand-over pipe")
            return line.strip() or None

        shard_ids: list[str] = []
        busy = work_through(take, self.lane.run, EXTRACT.default_slots(self.config), shard_ids.append)
        return {"finished": now(), "shard_ids": shard_ids, "busy": busy}

    def close(self) -> None:
        self.lane.close()


def serve_direct(lane: str, config_path: str, fd: int) -> None:
    """The child side of LaneProcess: a line in per job (the dataset), a JSON answer out per job."""
    # Answers go to the original stdout; anything else printed goes to the log with stderr.
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    config = load_config(config_path)
    side = DirectGenerate(config) if lane == "generate" else DirectExtract(config)
    with os.fdopen(fd, "w" if lane == "generate" else "r") as pipe:
        try:
            for line in sys.stdin:
                answer = "ready" if line.strip() == "ready" else side.run(Path(line.strip()), pipe)
                print(json.dumps(answer), file=answers, flush=True)
        finally:
            side.close()


class LaneProcess:
    """One lane of the direct way, in a child process of its own session, as each worker is: on a machine shared
    with other jobs the scheduler shares CPU time between sessions, so the direct lanes must not run in a session
    the workers do not share (or in this process, next to the event thread)."""

    def __init__(self, lane: str, config: Config, env: dict[str, str], log: Path, fd: int) -> None:
        self._log = open(log, "ab")
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--serve-direct", lane, str(config.source), str(fd)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            start_new_session=True,
            pass_fds=(fd,),
        )

    def send(self, line: str) -> None:
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def answer(self):
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the direct lane exited with {self.process.wait()}: see {self._log.name}")
        return json.loads(line)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)
        self._log.close()


class DirectLanes:
    """The direct way: a generate process handing shard ids to an extract process down a pipe."""

    def __init__(self, config: Config, env: dict[str, str], logs: Path) -> None:
        read_end, write_end = os.pipe()
        try:
            self.generate = LaneProcess("generate", config, env, logs / "direct-generate.log", write_end)
            self.extract = LaneProcess("extract", config, env, logs / "direct-extract.log", read_end)
        finally:
            os.close(read_end)
            os.close(write_end)
        for side in (self.generate, self.extract):
            side.send("ready")
        for side in (self.generate, self.extract):
            side.answer()

    def run(self, dataset: Path) -> tuple[float, list[str], dict[str, float]]:
        self.extract.send(str(dataset))
        self.generate.send(str(dataset))
        generated, extracted = self.generate.answer(), self.extract.answer()
        if sorted(generated["shard_ids"]) != sorted(extracted["shard_ids"]):
            raise RuntimeError("the direct extract process did not extract the shards the generate process made")
        phases = {"generate lane": generated["busy"], "extract lane": extracted["busy"]}
        return extracted["finished"] - generated["started"], generated["shard_ids"], phases

    def close(self) -> None:
        self.generate.close()
        self.extract.close()


PHASES = (
    "staging",
    "generate lane",
    "generate task",
    "generate dispatch",
    "extract lane",
    "extract task",
    "extract dispatch",
    "finish",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=256, help="samples per job (each round runs one job each way)")
    parser.add_argument("--shard-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--torch-threads", type=int, default=1, help="torch threads in every process")
    parser.add_argument("--model", type=Path, default=REPO / ".cache" / "tiny-qwen3")
    parser.add_argument("--timeline", type=Path, help="write every pipeline task's times (s from enqueue) as JSON")
    parser.add_argument("--serve-direct", nargs=3, help=argparse.SUPPRESS)  # lane, config, hand-over fd
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.serve_direct:
        lane, config_path, fd = args.serve_direct
        return serve_direct(lane, config_path, int(fd))
    threads = str(args.torch_threads)
    os.environ.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)

    model = build_tiny_model(args.model)
    rounds: list[Round] = []
    direct_phases: list[dict[str, float]] = []
    timelines: list[list[dict]] = []
    with tempfile.TemporaryDirectory(prefix="dfq-bench-") as tmp_name, RedisServer(Path(tmp_name) / "redis") as redis:
        tmp = Path(tmp_name)
        tables = tiny_config_tables(model, tmp / "queued", redis.url, tmp / "state")
        overrides = {
            "dataset": {"shard_size": args.shard_size, "thinking": "always"},
            "generate.sampling": {"max_tokens": args.max_tokens, "temperature": 0.8},
        }
        config = load_config(write_config(tmp / "bench.toml", tables, **overrides))
        direct_tables = tiny_config_tables(model, tmp / "direct", redis.url, tmp / "direct-state")
        direct_config = load_config(write_config(tmp / "direct.toml", direct_tables, **overrides))
        direct = DirectLanes(direct_config, dict(os.environ), tmp)
        try:
            with Pipeline(config, dict(os.environ), tmp) as pipeline:
                for index in range(args.rounds):
                    dataset = make_dataset(args.samples, tmp / f"prompts-{index}.jsonl", tag=f"round {index}")
                    load = load_average()
                    order = ("pipeline", "direct") if index % 2 == 0 else ("direct", "pipeline")
                    results = {}
                    for way in order:
                        results[way] = (pipeline if way == "pipeline" else direct).run(dataset)
                    pipeline_s, queued_ids, phases = results["pipeline"]
                    direct_s, direct_ids, lanes = results["direct"]
                    assert sorted(queued_ids) == sorted(direct_ids), "the pipeline and the direct lanes made other shards"
                    rounds.append(Round(load, pipeline_s, direct_s, len(direct_ids), phases))
                    direct_phases.append(lanes)
                    timelines.append(pipeline.timeline)
                    print(
                        f"round {index + 1} ({' then '.join(order)}), load {load:.2f}: pipeline {pipeline_s:.2f} s, "
                        f"direct {direct_s:.2f} s, pipeline / direct {rounds[-1].ratio:.3f}, "
                        f"(pipeline - direct) / shards = {rounds[-1].overhead_ms:+.1f} ms",
                        flush=True,
                    )
        finally:
            direct.close()

    if args.timeline:
        args.timeline.write_text(json.dumps(timelines, indent=1))
    shards = rounds[0].shards
    print()
    print(f"job: {args.samples} samples in {shards} shards of {args.shard_size}, max_tokens {args.max_tokens}, "
          f"torch threads {args.torch_threads}; {len(rounds)} rounds; load average (1 min) at each round's start: "
          + ", ".join(f"{r.load_before:.2f}" for r in rounds))
    print("per shard, ms (median of rounds) | pipeline | direct")
    for name in PHASES:
        queued = statistics.median(1000 * r.phases[name] / shards for r in rounds)
        mine = [1000 * d[name] / shards for d in direct_phases if name in d]
        alone = f"{statistics.median(mine):9.1f}" if mine else ""
        print(f"  {name:<18} {queued:9.1f} | {alone}")
    critical = ("staging", "generate task", "generate dispatch", "finish")
    figures = {
        "pipeline, s": [r.pipeline_s for r in rounds],
        "direct, s": [r.direct_s for r in rounds],
        "pipeline / direct": [r.ratio for r in rounds],
        "(pipeline - direct) / shards, ms": [r.overhead_ms for r in rounds],
        "queue's own time on the generate path, ms per shard": [
            sum(1000 * r.phases[name] for name in critical) / shards for r in rounds
        ],
    }
    print(f"  {f'over the {len(rounds)} rounds':<52} {'min':>8} {'median':>8} {'max':>8}")
    for name, values in figures.items():
        low, middle, high = spread(values)
        print(f"  {name:<52} {low:8.3f} {middle:8.3f} {high:8.3f}")
    print(f"(the queue's own time on the generate path: {' + '.join(critical)})")
    overhead = statistics.median(r.overhead_ms for r in rounds)
    print(f"(pipeline - direct) / shards = {overhead:+.1f} ms (median of rounds; target <= 50 ms)")

if __name__ == "__main__":
    main()
