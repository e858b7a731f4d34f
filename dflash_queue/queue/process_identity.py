"""A process as another process can recognise it later, even after its pid is reused: host, boot, pid namespace,
pid and start time. Whether it still runs can be told only from the same host, boot and pid namespace; elsewhere
the answer is "cannot tell" (None), and a caller falls back on a heartbeat."""

from __future__ import annotations

import os
import socket
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


def _read(path: str) -> str:
    try:
        return Path(path).read_text(encoding="ascii", errors="replace").strip()
    except OSError:
        return ""


def _start_ticks(pid: int) -> str:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat); "" without /proc, and for
    a zombie (it has ended; only its exit status waits to be read)."""
    stat = _read(f"/proc/{pid}/stat")
    # The command name (field 2) is in parentheses and may hold spaces: split after its closing one.
    fields = stat.rpartition(")")[2].split()
    if len(fields) <= 19 or fields[0] in ("Z", "X"):
        return ""
    return fields[19]


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


@dataclass(frozen=True)
class ProcessIdentity:
    host: str
    boot_id: str
    pid_namespace: str
    pid: int
    start_ticks: str

    @classmethod
    def of_this_process(cls) -> ProcessIdentity:
        return cls(
            host=socket.gethostname(),
            boot_id=_read("/proc/sys/kernel/random/boot_id"),
            pid_namespace=_pid_namespace(),
            pid=os.getpid(),
            start_ticks=_start_ticks(os.getpid()),
        )

    @classmethod
    def of_pid(cls, pid: int) -> ProcessIdentity:
        """A process of this host and pid namespace (a child this process started)."""
        here = cls.of_this_process()
        return cls(here.host, here.boot_id, here.pid_namespace, pid, _start_ticks(pid))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ProcessIdentity:
        return cls(
            host=str(data.get("host", "")),
            boot_id=str(data.get("boot_id", "")),
            pid_namespace=str(data.get("pid_namespace", "")),
            pid=int(data.get("pid", 0)),
            start_ticks=str(data.get("start_ticks", "")),
        )

    def visible_here(self) -> bool:
        """Whether this process can see that one's pid: same host, same boot, same pid namespace."""
        return not self.out_of_sight()

    def out_of_sight(self) -> str:
        """Why this process cannot see that one ("" when it can): another host, boot or pid namespace."""
        here = ProcessIdentity.of_this_process()
        if not (self.host and self.boot_id and self.pid_namespace):
            return "its process identity is not recorded"
        if self.host != here.host:
            return f"it runs on another host ({self.host})"
        if self.boot_id != here.boot_id:
            return f"it ran in another boot of {self.host} (or runs on another machine of that name)"
        if self.pid_namespace != here.pid_namespace:
            return f"it runs in another pid namespace ({self.pid_namespace}) on {self.host} (another container's)"
        return ""

    def running(self) -> bool | None:
        """True while that process runs, False once it has ended (its pid gone or taken by another process), None
        when this process cannot tell (another host, boot or pid namespace)."""
        if not self.visible_here() or self.pid <= 0:
            return None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # another user's process: it exists
        ticks = _start_ticks(self.pid)
        if not ticks:  # ended (a zombie), or exited between the two looks
            return False
        return ticks == self.start_ticks

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host or '?'}"
