"""A watchdog for the processes a command starts (a run's workers and private redis-server): they stop when the
command dies, however it dies.

Workers and the broker run in sessions of their own, so that a Ctrl-C reaches only their owner, which stops them in
order (workers warmly, the broker last). A SIGKILL, an OOM kill or a crash of the owner gives it no chance to: its
children would be reparented to init and go on for good, holding GPUs and memory. So the owner starts a guard, a
small process in a session of its own, holding the read end of a pipe whose only write end the owner holds, and
tells it through the pipe each child it starts. The kernel closes the write end when the owner exits, whatever
the cause; at that end of file the guard stops the children still running: workers warmly first (SIGTERM, as
`run`'s own stop: the running task finishes against a broker still up), their process group killed after
`warm_s`, then the broker (SIGTERM, so that it writes its AOF; killed after `BROKER_STOP_S`). After an owner that
stopped its children itself, it finds none running and exits. Children are recognised by pid and start time
(queue/process_identity.py), so a pid reused since is left alone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dflash_queue.queue.process_identity import ProcessIdentity

WORKER = "worker"
BROKER = "broker"
# How long a broker gets to write its AOF and exit before it is killed.
BROKER_STOP_S = 15.0
# How long a killed process group gets to be gone.
KILLED_S = 5.0


@dataclass(frozen=True)
class GuardedChild:
    name: str
    process: ProcessIdentity
    role: str  # WORKER (a process group of its own, stopped warmly) or BROKER (stopped after every worker)
    warm_s: float

    def to_line(self) -> bytes:
        data = {"name": self.name, "process": self.process.to_json(), "role": self.role, "warm_s": self.warm_s}
        return (json.dumps(data) + "\n").encode()

    @classmethod
    def from_line(cls, line: bytes) -> GuardedChild:
        data = json.loads(line)
        return cls(str(data["name"]), ProcessIdentity.from_json(data["process"]), str(data["role"]),
                   float(data["warm_s"]))


class ChildGuard:
    """The owner's side: `start()` the guard, `watch()` each child once started, `close()` once every child is
    stopped (or leave it to the process's exit). A context manager."""

    def __init__(self, log_path: Path | None = None) -> None:
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None
        self._write_fd: int | None = None

    def start(self) -> ChildGuard:
        read_fd, write_fd = os.pipe()  # both ends non-inheritable: children started later never hold them
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab") if self.log_path is not None else subprocess.DEVNULL
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "dflash_queue.queue.child_guard", str(read_fd), str(os.getpid())],
                pass_fds=(read_fd,),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # neither the terminal's Ctrl-C nor its hang-up reach it
            )
        finally:
            os.close(read_fd)
            if log is not subprocess.DEVNULL:
                log.close()  # type: ignore[union-attr]
        self._write_fd = write_fd
        return self

    def watch(self, name: str, pid: int, *, role: str, warm_s: float = 0.0) -> None:
        """A child that the guard stops if this process dies leaving it running."""
        if self._write_fd is None:
            return
        os.write(self._write_fd, GuardedChild(name, ProcessIdentity.of_pid(pid), role, warm_s).to_line())

    def close(self) -> None:
        """This process has stopped its children: the guard checks, finds none running, and exits."""
        if self._write_fd is not None:
            os.close(self._write_fd)
            self._write_fd = None

    def __enter__(self) -> ChildGuard:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _log(message: str) -> None:
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} child guard: {message}", flush=True)


def _signal(pid: int, signum: int, *, group: bool) -> None:
    try:
        if group:
            os.killpg(pid, signum)
        else:
            os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _wait_gone(children: list[GuardedChild], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while any(c.process.running() for c in children) and time.monotonic() < deadline:
        time.sleep(0.1)


def stop_children(children: list[GuardedChild], say: Callable[[str], None] | None = None) -> list[str]:
    """Stop those of `children` still running, workers before the broker; returns what was stopped and how, each
    also given to `say` as it is done."""
    said = []

    def stopped(line: str) -> None:
        said.append(line)
        if say is not None:
            say(line)

    workers = [c for c in children if c.role == WORKER and c.process.running()]
    for worker in workers:
        _signal(worker.process.pid, signal.SIGTERM, group=False)  # Celery's warm shutdown
        _signal(worker.process.pid, signal.SIGCONT, group=True)  # a stopped group could not act on it
    if workers:
        _wait_gone(workers, max(w.warm_s for w in workers))
    for worker in workers:
        warm = not worker.process.running()
        # The engine's processes are in the worker's group; any left once the worker is gone are swept too.
        _signal(worker.process.pid, signal.SIGKILL, group=True)
        stopped(f"{worker.name} (pid {worker.process.pid}) {'stopped warmly' if warm else 'killed'}")
    _wait_gone(workers, KILLED_S)
    for broker in (c for c in children if c.role == BROKER and c.process.running()):
        _signal(broker.process.pid, signal.SIGTERM, group=False)
        _wait_gone([broker], BROKER_STOP_S)
        warm = not broker.process.running()
        if not warm:
            _signal(broker.process.pid, signal.SIGKILL, group=False)
            _wait_gone([broker], KILLED_S)
        stopped(f"{broker.name} (pid {broker.process.pid}) {'stopped' if warm else 'killed'}")
    return said


def guard(read_fd: int, owner_pid: int) -> None:
    children: dict[str, GuardedChild] = {}
    with os.fdopen(read_fd, "rb") as pipe:
        for line in pipe:  # until the owner's end closes: it has exited, or stopped its children itself
            child = GuardedChild.from_line(line)
            children[child.name] = child
    left = [c for c in children.values() if c.process.running()]
    if left:
        _log(f"pid {owner_pid} exited leaving processes running: {', '.join(c.name for c in left)}; stopping them")
        stop_children(left, say=_log)


def main(argv: list[str]) -> int:
    for signum in (signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    guard(int(argv[0]), int(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
