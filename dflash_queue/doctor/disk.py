"""Free disk where this node writes: the state directory, local storage, and a staging directory if any."""

from __future__ import annotations

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
    where = existing_parent(path)
    free = shutil.disk_usage(where).free
    detail = f"{path}: {free / GB:,.1f} GB free"
    name = f"disk {label}"
    if free < fail_below_gb * GB:
        return Check.failed(name, f"{detail} (< {fail_below_gb:g} GB)")
    if free < warn_below_gb * GB:
        return Check.warned(name, f"{detail} (< {warn_below_gb:g} GB)")
    return Check.passed(name, detail)
