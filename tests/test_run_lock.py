"""One run per state directory: a second holder refused at once, naming the first; a killed holder's lock taken
over, and what it left running stopped. Real processes, real flock."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dflash_queue.run_lock import HOLDER_FILE, RunLock, StateDirInUse, refuse_foreign_worker

REPO = Path(__file__).resolve().parent.parent

HOLD = textwrap.dedent("""
    import subprocess, sys, time
    from dflash_queue.run_lock import RunLock
    lock = RunLock(sys.argv[1], "job-a").acquire()
    leftover = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    lock.record_child("redis-server", leftover.pid)
    print(leftover.pid, flush=True)
    time.sleep(120)
""")


def holding_process(state_dir: Path) -> tuple[subprocess.Popen, int]:
    """A process holding `state_dir`, with a child it recorded; returns it and the child's pid."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(state_dir)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    assert holder.stdout is not None
    return holder, int(holder.stdout.readline())


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"


def test_a_second_holder_is_refused_at_once_naming_the_first(tmp_path):
    holder, leftover = holding_process(tmp_path)
    try:
        started = time.monotonic()
        with pytest.raises(StateDirInUse) as refused:
            RunLock(tmp_path, "job-a").acquire()
        assert time.monotonic() - started < 1
        message = str(refused.value)
        assert f"pid {holder.pid} on " in message and "run 'job-a'" in message and "-c" in message
        # A worker of this job may join; one of another job is refused, naming the run.
        refuse_foreign_worker(tmp_path, "job-a")
        with pytest.raises(StateDirInUse, match=f"(?s)pid {holder.pid} .*another run name"):
            refuse_foreign_worker(tmp_path, "job-b")
    finally:
        holder.kill()
        holder.wait()
        os.kill(leftover, signal.SIGKILL)


def test_a_killed_holders_lock_is_taken_over_and_what_it_left_running_stopped(tmp_path):
    holder, leftover = holding_process(tmp_path)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert alive(leftover)  # in a session of its own, as the private redis-server is: SIGKILL of its owner spares it
    refuse_foreign_worker(tmp_path, "job-b")  # a dead holder holds nothing
    with RunLock(tmp_path, "job-a") as lock:
        assert lock.previous is not None and lock.previous.process.pid == holder.pid
        assert lock.stopped_leftovers == [f"redis-server (pid {leftover})"]
        assert not alive(leftover)
        assert json.loads((tmp_path / HOLDER_FILE).read_text())["pid"] == os.getpid()
    assert not (tmp_path / HOLDER_FILE).exists()
    with RunLock(tmp_path, "job-a") as again:  # released on exit
        assert again.previous is None and again.stopped_leftovers == []


def test_a_recorded_pid_now_taken_by_another_process_is_left_alone(tmp_path):
    holder, leftover = holding_process(tmp_path)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    record = json.loads((tmp_path / HOLDER_FILE).read_text())
    record["children"]["redis-server"]["start_ticks"] = "1"  # as if the pid had been reused since
    (tmp_path / HOLDER_FILE).write_text(json.dumps(record))
    try:
        with RunLock(tmp_path, "job-a") as lock:
            assert lock.stopped_leftovers == [] and alive(leftover)
    finally:
        os.kill(leftover, signal.SIGKILL)
