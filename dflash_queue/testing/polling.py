"""Waiting on real processes in tests and benchmarks."""

from __future__ import annotations

import time


def wait_for_states(ledger, shard_ids, wanted: set[str], timeout: float, workers=()) -> dict[str, str]:
    """Poll the ledger until every shard is in one of `wanted`, failing early if a worker died."""
    deadline = time.monotonic() + timeout
    while True:
        states = ledger.states(shard_ids)
        if len(states) == len(shard_ids) and set(states.values()) <= wanted:
            return states
        for worker in workers:
            if not worker.alive():
                raise AssertionError(f"{worker.lane} worker died:\n{worker.log_tail()}")
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {w.lane}\n{w.log_tail()}" for w in workers)
            raise AssertionError(f"timed out waiting for {wanted}; states {states}\n{logs}")
        time.sleep(0.2)
