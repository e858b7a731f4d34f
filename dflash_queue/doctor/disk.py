"""Free disk where this node writes: the state directory, local storage, and a staging directory if any."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from dflash_queue.doctor.result import Check

GB = 1000**3


def existing_parent(path: Path) -> Path:
    path = path.resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_free_disk(label: str, path: Path, *, warn_below_gb: float, fail_below_gb: float) -> Check:
    """Free space where `path` is, or, while it does not exist yet, on its nearest existing parent (said so), which
    must let it be created."""
    where = existing_parent(path)
    free = shutil.disk_usage(where).free
    name = f"disk {label}"
    if where == path.resolve():
        detail = f"{path}: {free / GB:,.1f} GB free"
    else:
        detail = f"{path}: missing (created at start); {free / GB:,.1f} GB free on {where}"
        if not os.access(where, os.W_OK | os.X_OK):
            return Check.failed(name, f"{detail}, which this user cannot create it in")
    if free < fail_below_gb * GB:
        return Check.failed(name, f"{detail} (< {fail_below_gb:g} GB)")
    if free < warn_below_gb * GB:
        return Check.warned(name, f"{detail} (< {warn_below_gb:g} GB)")
    return Check.passed(name, detail)
