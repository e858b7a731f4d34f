"""`dflash-queue run` stopped: Ctrl-C reaches the whole foreground process group, and the private broker
is not in it; one run per state directory. Real runs of the tiny model, real redis-server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_queue.run_lock import read_holder
from dflash_queue.shards.training import TrainingShard
from dfq_testing.configs import tiny_config_tables, write_config
from dfq_testing.jobs import first_lines
from dfq_testing.polling import wait_until
from dfq_testing.terminal import TerminalJob, foreground_job, script_background_job

REPO = Path(__file__).resolve().parent.parent
SAMPLE = REPO / "examples" / "sharegpt_sample.jsonl"
pytestmark = pytest.mark.slow


def slow_job(tiny_model: Path, tmp_path: Path, samples: int, shard_size: int = 8) -> tuple[list[str], Path]:
    """A run command whose tasks take a while (long replies), and its generate worker's log."""
    tables = tiny_config_tables(tiny_model, tmp_path / "out", "", tmp_path / "state")
    tables["dataset"]["shard_size"] = shard_size
    config = write_config(tmp_path / "run.toml", tables, **{"generate.sampling": {"max_tokens": 160}})
    dataset = first_lines(SAMPLE, samples, tmp_path / "prompts.jsonl")
    return [sys.executable, "-m", "dflash_queue", "run", str(dataset), "-c", str(config)], \
        tmp_path / "state" / "logs" / "generate.log"


def wait_for_task(process: subprocess.Popen, log: Path) -> None:
    def started():
        assert process.poll() is None, process.communicate()[1][-3000:]
        return log.exists() and "Task dfq.generate" in log.read_text()

    wait_until(started, 180, "the generate worker starting a task")


def started_processes(state_dir: Path) -> dict[str, int]:
    """What the run holding `state_dir` says it started (its redis-server, its workers): name -> pid."""
    holder = read_holder(state_dir)
    return {name: child.pid for name, child in holder.children.items()} if holder else {}


def left_running(pids: dict[str, int]) -> dict[str, int]:
    def alive(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
        except OSError:
            return False

    return {name: pid for name, pid in pids.items() if alive(pid)}


def guard_of(pid: int) -> int:
    """The pid of the guard process of the run `pid` (queue/child_guard.py)."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            words = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if b"dflash_queue.queue.child_guard" in words and str(pid).encode() in words:
            return int(cmdline.parent.name)
    raise AssertionError(f"no guard of pid {pid} runs")


def all_samples_once(out: Path, count: int) -> None:
    shards = sorted((out / "shards").glob("*.safetensors"))
    ids = [i for path in shards for i in TrainingShard(path).sample_ids]
    ids += [d["id"] for path in shards for d in TrainingShard(path).dropped]
    assert len(ids) == len(set(ids)) == count


def test_a_second_run_of_the_job_is_refused_at_once_and_a_killed_ones_state_taken_over(tiny_model, tmp_path):
    command, generate_log = slow_job(tiny_model, tmp_path, 8)
    first = foreground_job(command, own_group=True)
    try:
        wait_for_task(first, generate_log)
        # Its generate worker paused mid-task, so the first run cannot finish while the second one starts.
        os.killpg(started_processes(tmp_path / "state")["generate worker"], signal.SIGSTOP)
        assert first.poll() is None, first.communicate()[1][-3000:]
        started = time.monotonic()
        second = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert second.returncode == 1 and time.monotonic() - started < 30, second.stderr[-3000:]
        assert f"in use by `dflash-queue run` pid {first.pid} on " in second.stderr
        assert "started a private redis-server" not in second.stderr and "Traceback" not in second.stderr

        # A worker of another job on this state directory: refused the same way, before it loads anything.
        other = tmp_path / "other.toml"
        other.write_text((tmp_path / "run.toml").read_text().replace('name = "test"', 'name = "other-job"')
                         .replace('url = ""', 'url = "redis://127.0.0.1:1/0"', 1))
        worker = subprocess.run([sys.executable, "-m", "dflash_queue", "worker", "generate", "-c", str(other)],
                                capture_output=True, text=True, timeout=60)
        assert worker.returncode == 1 and f"pid {first.pid} on " in worker.stderr, worker.stderr[-3000:]
        assert "another run name" in worker.stderr

        started = started_processes(tmp_path / "state")
        # kill -9 of the run and its guard (as an OOM kill of both): its broker and workers are left running
        os.kill(guard_of(first.pid), signal.SIGKILL)
        first.send_signal(signal.SIGKILL)
        first.wait()
        assert set(left_running(started)) == {"redis-server", "generate worker", "extract worker"}
    finally:
        first.kill()
        first.communicate()
    third = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert third.returncode == 0, third.stderr[-4000:]
    assert "took over" in third.stderr and "redis-server (pid" in third.stderr and "generate worker (pid" \
        in third.stderr
    all_samples_once(tmp_path / "out", 8)
    assert left_running(started) == {}
    assert left_running(started_processes(tmp_path / "state")) == {}  # the holder file is gone with the run


def sessions_members(leaders: dict[str, int]) -> dict[str, int]:
    """Every running process in the sessions that `leaders` lead (a worker's engine processes are in its session),
    named after its leader."""
    members = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        for name, leader in leaders.items():
            if fields[0] not in ("Z", "X") and int(fields[3]) == leader:
                members[f"{name} / pid {stat.parent.name}"] = int(stat.parent.name)
    return members


def start_run(command: list[str], stop: signal.Signals) -> tuple[subprocess.Popen, TerminalJob | None]:
    """The run as each stop finds it: for SIGINT, started in the background of a script (SIGINT ignored, which
    the run takes back) and stopped with `kill -INT PID`; a closed terminal for a hang-up; else a process
    that `kill` and `timeout` signal."""
    if stop == signal.SIGHUP:
        terminal = TerminalJob(command)
        return terminal.process, terminal
    if stop == signal.SIGINT:
        return script_background_job(command), None
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True), None


def test_ctrl_c_sigterm_sighup_and_sigkill_each_stop_every_process_of_the_job_and_a_rerun_finishes(tiny_model,
                                                                                                   tmp_path):
    """`kill -INT` (a run in a script's background), `kill PID`, a closed terminal and `kill -9` in turn, mid-job: each time the running task finishes
    against a broker still up, and every process of the job (the workers, what runs in their sessions, the private
    broker) is gone within a minute; the next run takes over, and the job ends whole."""
    command, generate_log = slow_job(tiny_model, tmp_path, 32, shard_size=4)
    redis_log = tmp_path / "state" / "redis" / "redis.log"
    received = "] received"  # a task's first line in the worker's log: "Task dfq.generate[ID] received"
    for stop in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGKILL):
        log_before = len(generate_log.read_text()) if generate_log.exists() else 0
        redis_before = len(redis_log.read_text()) if redis_log.exists() else 0
        process, terminal = start_run(command, stop)

        def said(process=process, terminal=terminal) -> str:
            return terminal.text() if terminal else process.communicate()[1]

        def task_running(process=process, log_before=log_before) -> bool:
            assert process.poll() is None, said()[-3000:]
            return generate_log.exists() and received in generate_log.read_text()[log_before:]

        wait_until(task_running, 180, f"the run stopped by {stop.name} starting a task")
        started = started_processes(tmp_path / "state")
        assert set(started) == {"redis-server", "generate worker", "extract worker"}
        job = {**started, **sessions_members(started)}
        if stop == signal.SIGINT:
            os.kill(process.pid, signal.SIGINT)  # kill -INT $run, as docs/live-training.md stops its background run
        elif terminal:
            terminal.hang_up()
        else:
            process.send_signal(stop)
        process.wait(timeout=200)
        assert process.returncode == (-stop if stop == signal.SIGKILL else 128 + stop), said()[-3000:]
        wait_until(lambda job=job: left_running(job) == {}, 60, f"every process of the job gone after {stop.name}")

        log = generate_log.read_text()[log_before:]
        # The task running at the stop finished against a broker that was still up.
        assert "succeeded in" in log.split("Warm shutdown")[-1], log[-3000:]
        for trouble in ("heartbeat failed", "Connection refused", "Error 111", "Cannot connect"):
            assert trouble not in log, log[-3000:]
        assert "Received SIGTERM" in redis_log.read_text()[redis_before:]  # stopped by the run (or its guard) last
        if stop in (signal.SIGINT, signal.SIGTERM):
            assert "stopping workers: running tasks finish first" in (text := said()), text[-3000:]
            assert f"interrupted ({stop.name})" in text, text[-3000:]
        if stop == signal.SIGKILL:
            guard_log = (tmp_path / "state" / "logs" / "guard.log").read_text()
            assert f"pid {process.pid} exited leaving processes running" in guard_log, guard_log
            assert f"generate worker (pid {started['generate worker']}) stopped warmly" in guard_log, guard_log

    rerun = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-4000:]
    all_samples_once(tmp_path / "out", 32)
    verified = subprocess.run([*command[:3], "verify", *command[4:]], capture_output=True, text=True, timeout=300)
    assert verified.returncode == 0, verified.stdout[-3000:] + verified.stderr[-3000:]
    assert left_running(started_processes(tmp_path / "state")) == {}


def test_the_summary_says_which_shards_training_consumed_and_where_their_records_are(tmp_path):
    """A trainer followed the run with storage.retention = "until-consumed": the shards it consumed are gone from
    shards/, only their records are left, and the summary says so instead of pointing at files that are not there."""
    from dflash_queue.prompt_staging import EnqueueReport
    from dflash_queue.shards.consumed import ConsumedShard
    from dflash_queue.shards.keys import consumed_key, shard_key
    from dflash_queue.single_box import RunSummary, training_shards
    from dflash_queue.storage import open_storage

    storage = open_storage(str(tmp_path / "out"))
    storage.write_bytes(shard_key("kept"), b"a training shard")
    for shard_id in ("eaten-1", "eaten-2"):
        record = ConsumedShard(shard_id, 0, samples=["x"], flagged=[], dropped=[], num_tokens=12, consumers=["t"])
        storage.write_bytes(consumed_key(shard_id, 0), record.to_json())
    assert training_shards(storage) == ({"kept"}, {"eaten-1", "eaten-2"})

    output, records = f"{tmp_path}/out/shards/", f"{tmp_path}/out/consumed/0/"
    summary = RunSummary(EnqueueReport(), {}, 1.0, shards_done=3, output=output, shards_consumed=2,
                         consumed_records=records)
    (line,) = [line for line in summary.lines() if line.startswith("training shards:")]
    assert line.endswith(f"{output} (2 consumed by training and deleted (storage.retention = \"until-consumed\"), "
                         f"what each held recorded in {records})"), line
    summary.shards_done = 2
    (line,) = [line for line in summary.lines() if line.startswith("training shards:")]
    assert f"none left in {output}: all 2 consumed by training and deleted" in line, line
    summary.shards_consumed = 0
    (line,) = [line for line in summary.lines() if line.startswith("training shards:")]
    assert line == f"training shards:   {output}"
