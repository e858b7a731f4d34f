"""`dflash-queue run` from a terminal: Ctrl-C reaches the whole foreground process group, and the private broker
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
from dfq_testing.terminal import foreground_job

REPO = Path(__file__).resolve().parent.parent
SAMPLE = REPO / "examples" / "sharegpt_sample.jsonl"
pytestmark = pytest.mark.slow


def slow_job(tiny_model: Path, tmp_path: Path, samples: int) -> tuple[list[str], Path]:
    """A run command whose tasks take a while (long replies), and its generate worker's log."""
    tables = tiny_config_tables(tiny_model, tmp_path / "out", "", tmp_path / "state")
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


def all_samples_once(out: Path, count: int) -> None:
    shards = sorted((out / "shards").glob("*.safetensors"))
    ids = [i for path in shards for i in TrainingShard(path).sample_ids]
    ids += [d["id"] for path in shards for d in TrainingShard(path).dropped]
    assert len(ids) == len(set(ids)) == count


def test_ctrl_c_lets_the_running_task_finish_on_a_live_broker_and_a_rerun_resumes(tiny_model, tmp_path):
    command, generate_log = slow_job(tiny_model, tmp_path, 8)
    process = foreground_job(command, own_group=True)
    wait_for_task(process, generate_log)
    started = started_processes(tmp_path / "state")
    assert set(started) == {"redis-server", "generate worker", "extract worker"}
    os.killpg(process.pid, signal.SIGINT)  # Ctrl-C in the terminal
    interrupted = time.monotonic()
    _, stderr = process.communicate(timeout=240)
    assert process.returncode == 130, stderr[-3000:]
    assert "stopping workers: running tasks finish first" in stderr and "interrupted" in stderr
    assert time.monotonic() - interrupted < 200
    log = generate_log.read_text()
    # The task running at Ctrl-C finished against a broker that was still up.
    assert "succeeded in" in log.split("Warm shutdown")[-1] or "succeeded in" in log, log[-3000:]
    for trouble in ("heartbeat failed", "Connection refused", "Error 111", "Cannot connect"):
        assert trouble not in log, log[-3000:]
    redis_log = (tmp_path / "state" / "redis" / "redis.log").read_text()
    assert "Received SIGTERM" in redis_log and "SIGINT" not in redis_log  # stopped by run, not by the Ctrl-C
    assert left_running(started) == {}

    rerun = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-4000:]
    all_samples_once(tmp_path / "out", 8)


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
        first.send_signal(signal.SIGKILL)  # kill -9: its broker and workers are left running, orphaned
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
