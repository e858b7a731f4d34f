"""Waiting on real processes in tests and benchmarks."""

from __future__ import annotations

import time
from collections.abc import Iterable


def wait_until(predicate, timeout: float, what: str, workers: Iterable = (), poll_s: float = 0.2):
    """Poll `predicate` until it returns something truthy, and return that; fail early if a worker died."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        for worker in workers:
            if not worker.alive():
                raise AssertionError(f"{worker.lane} worker died while waiting for {what}:\n{worker.log_tail()}")
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {w.lane}\n{w.log_tail()}" for w in workers)
            raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{logs}")
        time.sleep(poll_s)


def wait_for_states(
    ledger, shard_ids, wanted: set[str], timeout: float, workers=(), poll_s: float = 0.2
) -> dict[str, str]:
    """Poll the ledger every `poll_s` until every shard is in one of `wanted`, failing early if a worker died."""
    shard_ids = list(shard_ids)
    last: dict[str, str] = {}

    def reached() -> dict[str, str] | None:
        last.clear()
        last.update(ledger.states(shard_ids))
        return dict(last) if len(last) == len(shard_ids) and set(last.values()) <= wanted else None

    try:
        return wait_until(reached, timeout, f"shards {wanted}", workers, poll_s=poll_s)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\nstates {last}") from None
