"""A dead worker's messages back on their queues within a minute, not after the visibility timeout (hours).

Redis has no lease: a message a worker took (running, or reserved for later) stays in kombu's `unacked` hash until
the worker acknowledges it or `broker.visibility_timeout_s` passes. So every worker

* keeps a heartbeat, `dfq:{run}:alive:{node}`, a key that expires `broker.worker_liveness_s` after its last
  refresh (every third of that, from a thread of its own, so a long task does not stop it);
* records each message it takes (Celery's `task_received`: running or reserved) in `dfq:{run}:held:{node}`,
  task id -> delivery tag, queue and shard, and forgets it when the task ends (`task_postrun`);
* on each beat, puts back the messages of every node whose heartbeat expired, where they are still unacknowledged,
  with kombu's own restore (a transaction: two workers restoring at once restore a message once), and forgets them.

A redelivered message counts against `broker.max_deliveries` like any other; the exactly-once accounting absorbs
a task run twice. A worker stopped warmly hands its messages back itself and removes its records.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class HeldMessage:
    node: str
    task_id: str
    tag: str
    queue: str
    shard_id: str
    # When the node was last heard of (its last heartbeat), and how long its heartbeat outlives that.
    last_seen: float
    ttl_s: float

    def back_by(self) -> float:
        """When a live worker will have put it back, at the latest: the heartbeat expired, and one more beat."""
        return self.last_seen + self.ttl_s * 4 / 3


class Liveness:
    """The heartbeats and held messages of a run's workers, in Redis."""

    def __init__(self, client: Any, run_name: str, ttl_s: int) -> None:
        self.client = client  # decode_responses=True
        self.prefix = f"dfq:{run_name}"
        self.ttl_s = ttl_s

    def _alive(self, node: str) -> str:
        return f"{self.prefix}:alive:{node}"

    def _held(self, node: str) -> str:
        return f"{self.prefix}:held:{node}"

    def _seen(self) -> str:
        return f"{self.prefix}:last_seen"

    def beat(self, node: str, *, now: float | None = None) -> None:
        now = time.time() if now is None else now
        pipe = self.client.pipeline()
        pipe.set(self._alive(node), repr(now), ex=self.ttl_s)
        pipe.hset(self._seen(), node, repr(now))
        pipe.execute()

    def took(self, node: str, task_id: str, tag: str, queue: str, shard_id: str) -> None:
        self.client.hset(self._held(node), task_id, json.dumps({"tag": tag, "queue": queue, "shard": shard_id}))

    def done(self, node: str, task_id: str) -> None:
        self.client.hdel(self._held(node), task_id)

    def leave(self, node: str) -> None:
        """A worker stopping warmly: its messages go back by kombu's own hand; nothing is held any more."""
        self.client.delete(self._alive(node), self._held(node))

    def held(self) -> list[HeldMessage]:
        """Every message a worker recorded taking and has not finished, whatever its heartbeat."""
        return self._held_messages(dead_only=False)

    def held_by_dead(self) -> list[HeldMessage]:
        """Messages recorded by nodes whose heartbeat stopped."""
        return self._held_messages(dead_only=True)

    def _held_messages(self, *, dead_only: bool) -> list[HeldMessage]:
        held = []
        seen = self.client.hgetall(self._seen())
        for key in self.client.scan_iter(match=self._held("*"), count=1000):
            node = key[len(self._held("")) :]
            if dead_only and self.client.exists(self._alive(node)):
                continue
            for task_id, raw in self.client.hgetall(key).items():
                fields = json.loads(raw)
                held.append(
                    HeldMessage(
                        node, task_id, fields["tag"], fields["queue"], fields["shard"], float(seen.get(node, 0)),
                        self.ttl_s,
                    )
                )
        return held
