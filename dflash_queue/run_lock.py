"""One `dflash-queue run` per state directory (`run.state_dir`): its private broker's data, staging files and logs
are the job's, and two runs on them would start two redis-servers on one AOF and do every task twice.

`run` takes an exclusive `flock` on `<state_dir>/run.lock` (the kernel releases it when the process dies, however
it dies) and writes beside it, in `run.json`, who holds it: pid, host, command, run name, start time, and the
processes it started (its redis-server and workers) as they start. A second `run` is refused at once, naming the
holder. A lock whose holder was killed (SIGKILL, OOM) is free; the processes the killed run left behind (a
redis-server still writing the AOF, workers still taking tasks) are stopped before the new run starts, their
unfinished tasks put back by the new run. A worker of another job (another run name) on a state directory a run
holds is refused the same way (`refuse_foreign_worker`).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shlex
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_queue.errors import ConfigError
from dflash_queue.queue.process_identity import ProcessIdentity

LOCK_FILE = "run.lock"
HOLDER_FILE = "run.json"
# How long a left-behind redis-server gets to write its AOF and exit before it is killed.
SERVER_STOP_S = 15.0


class StateDirInUse(ConfigError):
    """Another `dflash-queue run` holds the state directory."""


def this_command() -> str:
    try:
        words = Path("/proc/self/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
        return shlex.join(w.decode(errors="replace") for w in words)
    except OSError:
        return shlex.join([sys.executable, *sys.argv])


@dataclass
class Holder:
    """Who holds (or held) a state directory, and what it started."""

    process: ProcessIdentity
    command: str
    run_name: str
    started: float
    children: dict[str, ProcessIdentity] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "pid": self.process.pid,
            "host": self.process.host,
            "command": self.command,
            "run": self.run_name,
            "started": self.started,
            "process": self.process.to_json(),
            "children": {name: child.to_json() for name, child in self.children.items()},
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Holder:
        return cls(
            process=ProcessIdentity.from_json(data.get("process") or {"pid": data.get("pid", 0)}),
            command=str(data.get("command", "")),
            run_name=str(data.get("run", "")),
            started=float(data.get("started", 0)),
            children={str(k): ProcessIdentity.from_json(v) for k, v in (data.get("children") or {}).items()},
        )

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started)) if self.started else "?"
        return f"pid {self.process.pid} on {self.process.host or '?'} (run {self.run_name!r}, since {when}: " \
            f"{self.command or '?'})"


def read_holder(state_dir: Path) -> Holder | None:
    try:
        return Holder.from_json(json.loads((state_dir / HOLDER_FILE).read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def running_holder(state_dir: Path) -> Holder | None:
    """The run holding `state_dir` now, as far as this machine can tell (a holder on another host counts)."""
    holder = read_holder(Path(state_dir))
    if holder is None or holder.process.running() is False:
        return None
    return holder


class RunLock:
    """The state directory held by this process for the run's duration (a context manager)."""

    def __init__(self, state_dir: str | os.PathLike[str], run_name: str) -> None:
        self.state_dir = Path(state_dir)
        self.run_name = run_name
        self._fd: int | None = None
        self.holder: Holder | None = None
        # What a killed run before this one left running and this one stopped: "redis-server (pid N)", ...
        self.stopped_leftovers: list[str] = []
        self.previous: Holder | None = None

    def acquire(self) -> RunLock:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.state_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                raise
            holder = read_holder(self.state_dir)
            who = holder.describe() if holder else "another process (it has not said which yet)"
            raise StateDirInUse(
                f"{self.state_dir} is in use by `dflash-queue run` {who}: one run per state directory; wait for it "
                "to finish, or stop it (Ctrl-C in its terminal, or kill -INT its pid), then run again"
            ) from None
        self._fd = fd
        self.previous = read_holder(self.state_dir)
        if self.previous is not None:
            self.stopped_leftovers = stop_leftovers(self.previous)
        self.holder = Holder(ProcessIdentity.of_this_process(), this_command(), self.run_name, time.time())
        self._write()
        return self

    def record_child(self, name: str, pid: int) -> None:
        """A process this run started: stopped by the next run if this one is killed and leaves it running."""
        assert self.holder is not None
        self.holder.children[name] = ProcessIdentity.of_pid(pid)
        self._write()

    def forget_child(self, name: str) -> None:
        if self.holder is not None and self.holder.children.pop(name, None) is not None:
            self._write()

    def _write(self) -> None:
        assert self.holder is not None
        path = self.state_dir / HOLDER_FILE
        temporary = path.with_name(f".{HOLDER_FILE}.{os.getpid()}.tmp")
        temporary.write_text(json.dumps(self.holder.to_json(), indent=1) + "\n", encoding="utf-8")
        os.replace(temporary, path)

    def release(self) -> None:
        if self._fd is None:
            return
        (self.state_dir / HOLDER_FILE).unlink(missing_ok=True)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def stop_leftovers(previous: Holder) -> list[str]:
    """Stop what a killed run left running: its workers at once (their tasks come back: the new run puts every
    unacknowledged message back), then its redis-server, given time to write its AOF."""
    stopped = []
    children = [(n, c) for n, c in previous.children.items() if c.running() is True]
    for name, child in sorted(children, key=lambda item: item[0] == "redis-server"):
        if name == "redis-server":
            _signal(child.pid, signal.SIGTERM, group=False)
            deadline = time.monotonic() + SERVER_STOP_S
            while child.running() and time.monotonic() < deadline:
                time.sleep(0.05)
            if child.running():
                _signal(child.pid, signal.SIGKILL, group=False)
        else:  # a worker leads a process group of its own (its engine's processes are in it)
            _signal(child.pid, signal.SIGKILL, group=True)
        deadline = time.monotonic() + 5
        while child.running() and time.monotonic() < deadline:
            time.sleep(0.05)
        stopped.append(f"{name} (pid {child.pid})")
    return stopped


def _signal(pid: int, signum: int, *, group: bool) -> None:
    try:
        if group and os.getpgid(pid) == pid:
            os.killpg(pid, signum)
        else:
            os.kill(pid, signum)
    except ProcessLookupError:
        pass


def refuse_foreign_worker(state_dir: str | os.PathLike[str], run_name: str) -> None:
    """A worker on a state directory that a run of another job holds: refused, naming that run."""
    holder = running_holder(Path(state_dir))
    if holder is not None and holder.run_name != run_name:
        raise StateDirInUse(
            f"{state_dir} is in use by `dflash-queue run` {holder.describe()}, a job of another run name "
            f"({holder.run_name!r}, this worker's is {run_name!r}): give this job a run.state_dir of its own"
        )
