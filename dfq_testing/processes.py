"""Looking for processes left behind: the children an engine or a worker started must not outlive it."""

from __future__ import annotations

import time

import psutil


def descendants(pid: int) -> list[psutil.Process]:
    """Every live process below `pid` (children, their children, ...)."""
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _alive(process: psutil.Process) -> bool:
    try:
        # A zombie has exited and holds no memory; it only waits for its parent to read its status.
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def survivors(processes: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Those of `processes` still alive after waiting up to `timeout` seconds for them to exit."""
    deadline = time.monotonic() + timeout
    alive = [p for p in processes if _alive(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [p for p in alive if _alive(p)]
    return alive


def describe(processes: list[psutil.Process]) -> str:
    lines = []
    for process in processes:
        try:
            lines.append(f"pid {process.pid} {process.name()} ({process.status()})")
        except psutil.NoSuchProcess:
            lines.append(f"pid {process.pid} (gone)")
    return ", ".join(lines)
