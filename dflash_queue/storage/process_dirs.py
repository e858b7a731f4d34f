"""Directories a process owns under a shared local directory, named after this host and the process
(`{prefix}{host}-{pid}`, with a random tag where a process has several), and removed by the next process on this
host to make one when the process that made them no longer runs (a killed process cannot clean up after itself).
The uploader stages shards in one; the vLLM extract engine receives states in one."""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import uuid
from pathlib import Path

log = logging.getLogger(__name__)


def host_tag() -> str:
    """This host's name as it appears in a directory's name."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname())[:64]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_dead_process_dirs(base: Path, prefix: str = "") -> list[Path]:
    """Remove the directories under `base` named `prefix` + this host + a pid (+ a tag) whose process no longer
    runs; another host's are not this host's to judge."""
    removed: list[Path] = []
    if not base.is_dir():
        return removed
    pattern = re.compile(rf"^{re.escape(prefix)}{re.escape(host_tag())}-(\d+)(?:-[0-9a-f]+)?$")
    for entry in base.iterdir():
        match = pattern.match(entry.name)
        if not (match and entry.is_dir()):
            continue
        pid = int(match.group(1))
        if pid != os.getpid() and not pid_alive(pid):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    if removed:
        log.info("removed %d directories of processes gone under %s", len(removed), base)
    return removed


def make_process_dir(base: Path, prefix: str = "", *, tagged: bool = False) -> Path:
    """This process's directory under `base` (made, with `base`, if missing), once the directories of this host's
    dead processes are removed. `tagged`: a new directory on each call (a random tag after the pid), for a process
    that holds several; else the one directory of this process, reused."""
    base.mkdir(parents=True, exist_ok=True)
    remove_dead_process_dirs(base, prefix)
    name = f"{prefix}{host_tag()}-{os.getpid()}"
    if tagged:
        path = base / f"{name}-{uuid.uuid4().hex[:8]}"
        path.mkdir()
    else:
        path = base / name
        path.mkdir(exist_ok=True)
    return path
