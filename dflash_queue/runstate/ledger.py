"""Run state in Redis: where each shard stands, the run's counters, and their recent rates.

The ledger is bookkeeping for progress and skip decisions; storage stays the truth about what is done
(a shard whose training file exists is done whatever the ledger says).

Rates: every `add` also lands in a per-minute bucket (a hash that expires after `RATE_RETENTION_S`), in the
same transaction as the totals, so any counter any lane records gets a recent rate for free and both survive
worker restarts.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from dflash_queue.runstate.keys import RunKeys
from dflash_queue.runstate.redis_connect import redis_client
from dflash_queue.runstate.shard_states import CANARY_ERROR, DONE, FAILED, GENERATED, IN_PROGRESS_OR_DONE, QUEUED

__all__ = ["CANARY_ERROR", "DONE", "FAILED", "GENERATED", "IN_PROGRESS_OR_DONE", "QUEUED", "Ledger"]

# How long a task's delivery count is kept: longer than any task is retried or re-delivered.
DELIVERY_TTL_S = 7 * 24 * 3600

RATE_BUCKET_S = 60
# The longest window a rate can be asked for; older buckets expire.
RATE_RETENTION_S = 6 * 3600


@dataclass(frozen=True)
class WindowTotals:
    """Counter increments recorded over the last `span_s` seconds (the window, or less for a younger run)."""

    totals: dict[str, int]
    span_s: float

    def rate(self, name: str) -> float:
        """Per second; 0.0 when the window is empty."""
        return self.totals.get(name, 0) / self.span_s if self.span_s > 0 else 0.0


class Ledger:
    def __init__(self, client: redis.Redis, run_name: str) -> None:
        # Made with decode_responses=True: every reply is str (redis-py's types cannot say so).
        self.client: Any = client
        self.keys = RunKeys(run_name)
        self.states_key = self.keys.shard_states
        self.sizes_key = self.keys.shard_samples
        self.counters_key = self.keys.counters
        self.failures_key = self.keys.failures
        # When the first progress of this run was recorded: the start of the rate window of a young run.
        self.first_add_key = self.keys.first_add
        self.counted_key = self.keys.counted
        # Largest values seen of measurements that are not counts (a canary's relative error).
        self.maxima_key = self.keys.maxima
        # What the run's output is made with (dflash_queue.runstate.run_identity), as recorded by its first producer.
        self.identity_key = self.keys.identity

    @classmethod
    def from_url(cls, url: str, run_name: str) -> Ledger:
        return cls(resilient_client(url), run_name)

    def claim_identity(self, identity: str) -> str | None:
        """Record the run's identity unless one is recorded; returns the one recorded before (None: none was)."""
        pipe = self.client.pipeline()
        pipe.set(self.identity_key, identity, nx=True)
        pipe.get(self.identity_key)
        claimed, recorded = pipe.execute()
        return None if claimed else recorded

    def replace_identity(self, identity: str) -> None:
        self.client.set(self.identity_key, identity)

    def count_delivery(self, task_id: str, retries: int = 0, *, by: int = 1) -> int:
        """Count one more delivery of a task (a retry is a new message and counts afresh); returns the count.

        Counted when the task starts, so deliveries whose worker was killed before it could record anything
        (OOM-kill, segfault, SIGKILL) are counted too.
        """
        key = self.keys.delivery(task_id, retries)
        pipe = self.client.pipeline()
        pipe.incrby(key, by)
        pipe.expire(key, DELIVERY_TTL_S)
        count, _ = pipe.execute()
        return int(count)

    def deliveries(self) -> dict[tuple[str, int], int]:
        """How many times each message (task id, retries) was delivered, of those counted in the last
        DELIVERY_TTL_S."""
        prefix = self.keys.delivery_prefix
        counts = {}
        for key in self.client.scan_iter(match=prefix + "*", count=1000):
            task_id, retries = key[len(prefix) :].rsplit(":", 1)
            counts[(task_id, int(retries))] = int(self.client.get(key) or 0)
        return counts

    def add_once(self, token: str, counts: Mapping[str, int], *, now: float | None = None) -> bool:
        """`add`, unless counts under the same token were added before (a task delivered twice that wrote the
        same output twice must not count it twice). Returns whether the counts were added."""
        if not self.client.sadd(self.counted_key, token):
            return False
        self.add(counts, now=now)
        return True

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

    def add(self, counts: Mapping[str, int], *, now: float | None = None) -> None:
        """Add to the run's counters and to the current minute's bucket, atomically."""
        now = time.time() if now is None else now
        bucket_key = self.keys.rate_bucket(int(now // RATE_BUCKET_S))
        pipe = self.client.pipeline()
        for name, value in counts.items():
            if value:
                pipe.hincrby(self.counters_key, name, int(value))
                pipe.hincrby(bucket_key, name, int(value))
        if len(pipe):
            pipe.expire(bucket_key, RATE_RETENTION_S + RATE_BUCKET_S)
            pipe.set(self.first_add_key, repr(now), nx=True)
            pipe.execute()

    def window(self, window_s: float, *, now: float | None = None) -> WindowTotals:
        """Increments of every counter over the last `window_s` seconds, rounded up to whole minutes.

        The span is measured from the start of the oldest bucket in the window, or from the run's first
        recorded progress when that is later, so a young run's rate is not diluted by time before it began.
        """
        if not 0 < window_s <= RATE_RETENTION_S:
            raise ValueError(f"window must be within (0, {RATE_RETENTION_S}] seconds, got {window_s}")
        now = time.time() if now is None else now
        current = int(now // RATE_BUCKET_S)
        buckets = range(current - math.ceil(window_s / RATE_BUCKET_S) + 1, current + 1)
        pipe = self.client.pipeline(transaction=False)
        pipe.get(self.first_add_key)
        for bucket in buckets:
            pipe.hgetall(self.keys.rate_bucket(bucket))
        first_add, *contents = pipe.execute()
        totals: dict[str, int] = {}
        for content in contents:
            for name, value in content.items():
                totals[name] = totals.get(name, 0) + int(value)
        start: float = buckets[0] * RATE_BUCKET_S
        if first_add is not None:
            start = max(start, float(first_add))
        return WindowTotals(totals, max(0.0, now - start))

    def counters(self) -> dict[str, int]:
        return {name: int(value) for name, value in self.client.hgetall(self.counters_key).items()}

    def record_max(self, name: str, value: float) -> None:
        """Keep the largest `value` ever recorded under `name` (atomic; recording twice changes nothing)."""
        self.client.eval(_RECORD_MAX, 1, self.maxima_key, name, repr(float(value)))

    def maxima(self) -> dict[str, float]:
        return {name: float(value) for name, value in self.client.hgetall(self.maxima_key).items()}

    def shard_sizes(self) -> dict[str, int]:
        """Samples per shard, recorded when the shard was queued."""
        return {shard_id: int(n) for shard_id, n in self.client.hgetall(self.sizes_key).items()}

    def failures(self) -> dict[str, str]:
        return self.client.hgetall(self.failures_key)

    def reset(self) -> None:
        buckets = list(self.client.scan_iter(match=f"{self.keys.rate_prefix}*", count=1000))
        # A live dataset's state (epochs, window, consumers) belongs to the run started over.
        buckets += list(self.client.scan_iter(match=f"{self.keys.live_prefix}*", count=1000))
        self.client.delete(
            self.states_key,
            self.sizes_key,
            self.counters_key,
            self.failures_key,
            self.first_add_key,
            self.counted_key,
            self.maxima_key,
            self.identity_key,
            self.keys.served_weights,  # servers with other weights may generate the run started over
            *buckets,
        )


_RECORD_MAX = """
local current = redis.call('HGET', KEYS[1], ARGV[1])
if not current or tonumber(ARGV[2]) > tonumber(current) then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
end
"""


def resilient_client(url: str) -> redis.Redis:
    """A client that rides out a broker restart, or a Sentinel failover (a `sentinel://` URL: the primary found
    again through the sentinels): commands retried with backoff for about a minute."""
    return redis_client(
        url,
        decode_responses=True,
        retry=Retry(ExponentialBackoff(cap=8.0, base=0.25), retries=12),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        health_check_interval=25,
    )
