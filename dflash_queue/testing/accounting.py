"""Checks shared by the fault tests: the job's outcome, accounted for by `verify`."""

from __future__ import annotations

import time
from pathlib import Path

from dflash_queue.config import Config
from dflash_queue.verify import VerifyReport, verify


def assert_accounted(config: Config, dataset: Path, *, done: int, dead: int = 0) -> VerifyReport:
    """Every sample exactly once, with `done` in shards and `dead` in dead letters."""
    report = verify(config, [dataset])
    assert report.ok, "\n".join(report.lines())
    assert (report.done + report.dropped, report.dead) == (done, dead), "\n".join(report.lines())
    return report


def wait_accounted(config: Config, dataset: Path, *, done: int, dead: int = 0, timeout: float = 300, workers=()) -> VerifyReport:
    """Poll `verify` until the job reaches the expected outcome (or fail with the last report)."""
    deadline = time.monotonic() + timeout
    while True:
        report = verify(config, [dataset])
        if report.ok and (report.done + report.dropped, report.dead) == (done, dead):
            return report
        for worker in workers:
            if not worker.alive():
                raise AssertionError(f"{worker.lane} worker died:\n{worker.log_tail()}")
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {w.lane}\n{w.log_tail()}" for w in workers)
            raise AssertionError("\n".join(report.lines()) + "\n" + logs)
        time.sleep(1.0)
