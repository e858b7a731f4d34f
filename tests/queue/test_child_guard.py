"""The guard that stops a command's workers and broker when the command dies (queue/child_guard.py): real processes,
the owner SIGKILLed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from dflash_queue.queue.child_guard import BROKER, WORKER, GuardedChild, stop_children
from dflash_queue.queue.process_identity import ProcessIdentity
from dfq_testing.polling import wait_until

# A worker: on SIGTERM it notes the time and exits after a moment (a task finishing); it leaves a child in its
# process group that ignores SIGTERM (an engine process that outlives it). With IGNORE_TERM it ignores SIGTERM.
WORKER_SCRIPT = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    from pathlib import Path
    notes = Path(sys.argv[1])
    engine = subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
    notes.with_suffix(".engine").write_text(str(engine.pid))
    def warm(signum, frame):
        notes.write_text(f"{time.time()}")
        time.sleep(0.5)
        os._exit(0)
    signal.signal(signal.SIGTERM, signal.SIG_IGN if os.environ.get("IGNORE_TERM") else warm)
    while True:
        time.sleep(1)
""")

BROKER_SCRIPT = textwrap.dedent("""
    import signal, sys, time
    from pathlib import Path
    def stop(signum, frame):
        Path(sys.argv[1]).write_text(f"{time.time()}")
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    while True:
        time.sleep(1)
""")

# The owner: starts the guard and its children, says their pids, then sleeps (or stops them itself with STOP_SELF).
OWNER_SCRIPT = textwrap.dedent("""
    import json, os, signal, subprocess, sys, time
    from pathlib import Path
    from dflash_queue.queue.child_guard import BROKER, WORKER, ChildGuard
    work = Path(sys.argv[1])
    guard = ChildGuard(work / "guard.log").start()
    broker = subprocess.Popen([sys.executable, str(work / "broker.py"), str(work / "broker.stopped")],
                              start_new_session=True)
    guard.watch("redis-server", broker.pid, role=BROKER)
    worker = subprocess.Popen([sys.executable, str(work / "worker.py"), str(work / "worker.stopped")],
                              start_new_session=True)
    guard.watch("extract worker", worker.pid, role=WORKER, warm_s=float(sys.argv[2]))
    while not (work / "worker.engine").exists():
        time.sleep(0.05)
    print(json.dumps({"guard": guard.process.pid, "broker": broker.pid, "worker": worker.pid}), flush=True)
    if os.environ.get("STOP_SELF"):
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
        broker.terminate()
        broker.wait()
        guard.close()
        print("stopped", flush=True)
    sys.stdin.read()
""")


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] not in ("Z", "X")
    except OSError:
        return False


def start_owner(tmp_path: Path, warm_s: float, **env: str) -> tuple[subprocess.Popen, dict[str, int]]:
    (tmp_path / "worker.py").write_text(WORKER_SCRIPT)
    (tmp_path / "broker.py").write_text(BROKER_SCRIPT)
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER_SCRIPT, str(tmp_path), str(warm_s)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, **env},
    )
    assert owner.stdout is not None
    pids = json.loads(owner.stdout.readline())
    pids["engine"] = int((tmp_path / "worker.engine").read_text())
    return owner, pids


def test_an_owner_killed_leaves_nothing_running_workers_stopped_warmly_before_the_broker(tmp_path):
    owner, pids = start_owner(tmp_path, warm_s=30)
    assert all(running(pid) for pid in pids.values())
    owner.kill()  # kill -9: no chance to stop anything itself
    owner.wait()
    wait_until(lambda: not any(running(pid) for pid in pids.values()), 60, "every child of the killed owner gone")
    # The worker was asked warmly (SIGTERM) and had stopped before the broker was asked.
    assert float((tmp_path / "worker.stopped").read_text()) < float((tmp_path / "broker.stopped").read_text())
    log = (tmp_path / "guard.log").read_text()
    assert f"pid {owner.pid} exited leaving processes running" in log
    assert f"extract worker (pid {pids['worker']}) stopped warmly" in log
    assert f"redis-server (pid {pids['broker']}) stopped" in log


def test_a_worker_that_does_not_stop_warmly_is_killed_with_its_group_after_its_time(tmp_path):
    owner, pids = start_owner(tmp_path, warm_s=2, IGNORE_TERM="1")
    owner.kill()
    owner.wait()
    killed = time.monotonic()
    wait_until(lambda: not any(running(pid) for pid in pids.values()), 60, "every child of the killed owner gone")
    assert time.monotonic() - killed >= 1.5  # given its warm time first
    assert not (tmp_path / "worker.stopped").exists()
    assert f"extract worker (pid {pids['worker']}) killed" in (tmp_path / "guard.log").read_text()


def test_an_owner_that_stopped_its_children_leaves_a_guard_that_exits_and_says_nothing(tmp_path):
    owner, pids = start_owner(tmp_path, warm_s=30, STOP_SELF="1")
    assert owner.stdout is not None and owner.stdout.readline().strip() == "stopped"
    wait_until(lambda: not running(pids["guard"]), 30, "the guard exiting")
    owner.kill()
    owner.wait()
    assert "stopped" not in (tmp_path / "guard.log").read_text()


def test_a_pid_now_taken_by_another_process_is_left_alone(tmp_path):
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        wait_until(lambda: ProcessIdentity.of_pid(stranger.pid).start_ticks != "", 10, "the process started")
        identity = ProcessIdentity.of_pid(stranger.pid)
        earlier = ProcessIdentity(identity.host, identity.boot_id, identity.pid_namespace, identity.pid,
                                  str(int(identity.start_ticks) - 1))
        said = stop_children([GuardedChild("extract worker", earlier, WORKER, 1.0),
                              GuardedChild("redis-server", earlier, BROKER, 0.0)])
        assert said == [] and stranger.poll() is None
        said = stop_children([GuardedChild("extract worker", identity, WORKER, 1.0)])
        assert said == [f"extract worker (pid {stranger.pid}) stopped warmly"]
        stranger.wait(timeout=10)
    finally:
        stranger.kill()
        stranger.wait()
