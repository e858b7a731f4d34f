"""Run state in Redis: where each shard stands, and the run's counters.

The ledger is bookkeeping for progress and skip decisions; storage stays the truth about what is done
(a shard whose training file exists is done whatever the ledger says).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import redis

QUEUED = "queued"
GENERATED = "generated"
DONE = "done"
FAILED = "failed"
# States in which a shard needs no new message from the producer.
IN_PROGRESS_OR_DONE = frozenset({QUEUED, GENERATED, DONE})


class Ledger:
    def __init__(self, client: redis.Redis, run_name: str) -> None:
        self.client = client
        self.prefix = f"dfq:{run_name}"
        self.states_key = f"{self.prefix}:shard_state"
        self.sizes_key = f"{self.prefix}:shard_samples"
        self.counters_key = f"{self.prefix}:counters"
        self.failures_key = f"{self.prefix}:failures"

    @classmethod
    def from_url(cls, url: str, run_name: str) -> Ledger:
        return cls(redis.Redis.from_url(url, decode_responses=True), run_name)

    def set_state(self, shard_id: str, state: str, *, num_samples: int | None = None) -> None:
        pipe = self.client.pipeline()
        pipe.hset(self.states_key, shard_id, state)
        if num_samples is not None:
            pipe.hset(self.sizes_key, shard_id, num_samples)
        pipe.execute()

    def mark_queued(self, sizes: Mapping[str, int]) -> None:
        """Mark many shards queued (with their sample counts) in one round trip."""
        if not sizes:
            return
        pipe = self.client.pipeline(transaction=False)
        pipe.hset(self.states_key, mapping={shard_id: QUEUED for shard_id in sizes})
        pipe.hset(self.sizes_key, mapping=dict(sizes))
        pipe.execute()

    def forget(self, shard_ids: Iterable[str]) -> None:
        """Remove shards' states (a message that was never sent)."""
        ids = list(shard_ids)
        if ids:
            self.client.hdel(self.states_key, *ids)

    def mark_failed(self, shard_id: str, error: str) -> None:
        pipe = self.client.pipeline()
        pipe.hset(self.states_key, shard_id, FAILED)
        pipe.hset(self.failures_key, shard_id, error)
        pipe.execute()

    def failure(self, shard_id: str) -> str:
        return self.client.hget(self.failures_key, shard_id) or ""

    def states(self, shard_ids: Iterable[str] | None = None) -> dict[str, str]:
        if shard_ids is None:
            return self.client.hgetall(self.states_key)
        ids = list(shard_ids)
        if not ids:
            return {}
        values = self.client.hmget(self.states_key, ids)
        return {shard_id: value for shard_id, value in zip(ids, values) if value is not None}

    def add(self, counts: Mapping[str, int]) -> None:
        pipe = self.client.pipeline()
        for name, value in counts.items():
            if value:
                pipe.hincrby(self.counters_key, name, int(value))
        pipe.execute()

    def counters(self) -> dict[str, int]:
        return {name: int(value) for name, value in self.client.hgetall(self.counters_key).items()}

    def reset(self) -> None:
        self.client.delete(self.states_key, self.sizes_key, self.counters_key, self.failures_key)
