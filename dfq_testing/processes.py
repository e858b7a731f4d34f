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


class TreeWatch:
    """Every process seen below `pid` while it runs (polled from a thread): those that were reparented away (a
    child in a session of its own outlives its parent) are still checked afterwards. A context manager."""

    def __init__(self, pid: int, poll_s: float = 0.25) -> None:
        import threading

        self.pid = pid
        self.poll_s = poll_s
        self.seen: dict[tuple[int, float], psutil.Process] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for process in descendants(self.pid):
                try:
                    self.seen.setdefault((process.pid, process.create_time()), process)
                except psutil.NoSuchProcess:
                    pass
            self._stop.wait(self.poll_s)

    def __enter__(self) -> TreeWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def survivors(self, timeout: float) -> list[psutil.Process]:
        """Those seen that are still alive (the same processes: a reused pid is another process) after up to
        `timeout` seconds."""
        return survivors(list(self.seen.values()), timeout)
