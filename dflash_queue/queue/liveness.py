"""A dead worker's messages back on their queues within a minute, not after the visibility timeout (hours).

Redis has no lease: a message a worker took (running, or reserved for later) stays in kombu's `unacked` hash until
the worker acknowledges it or `broker.visibility_timeout_s` passes. So every worker process is an *incarnation*
(a random id drawn when it starts), and its records are keyed by that id, never by its node name: a worker
restarted under the same name (systemd restarts `LANE-%i@%h` 30 s after a crash) is another incarnation, so it
can neither refresh its dead predecessor's heartbeat nor inherit its records. Every incarnation

* registers itself in `dfq:{run}:incarnations` (id -> node name and process identity: host, boot, pid namespace,
  pid, start time);
* keeps a heartbeat, `dfq:{run}:alive:{incarnation}`, a key that expires `broker.worker_liveness_s` after its last
  refresh (every third of that, from a thread of its own, so a long task does not stop it);
* records each message it takes (Celery's `task_received`: running or reserved) in `dfq:{run}:held:{incarnation}`,
  task id -> delivery tag, queue and shard, and forgets it when the task ends (`task_postrun`);
* on each beat, puts back the messages of every dead incarnation, where they are still unacknowledged, with
  kombu's own restore (a transaction: two workers restoring at once restore a message once), and forgets it.

An incarnation is dead when its heartbeat expired, or at once when its process is seen gone (same host, boot and
pid namespace: the pid no longer runs, or runs another process). A process this one cannot see (another host, boot
or pid namespace: workers in containers with host networking share a host name) is alive while its heartbeat is.

A worker starting under a node name whose records exist succeeds the dead incarnations among them: it puts back
what they held before it takes anything. A namesake that is alive (its heartbeat fresh, and its process running or
out of sight) is no predecessor: its messages stay its own, and the starting worker is refused, naming it (two live
workers under one name would put back each other's messages). One seen running whose heartbeat stopped (a frozen
heartbeat thread) is left to its heartbeat as well: the beats of the run's workers put back what it held. A
redelivered message counts against `broker.max_deliveries` like any other. A worker stopped warmly hands its
messages back itself and removes its records.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from dflash_queue.queue.process_identity import ProcessIdentity
from dflash_queue.runstate.keys import RunKeys


@dataclass(frozen=True)
class Incarnation:
    """One worker process: its id, the node name it runs under, the process."""

    id: str
    node: str
    process: ProcessIdentity
    started: float

    @classmethod
    def of_this_process(cls, node: str) -> Incarnation:
        return cls(uuid.uuid4().hex, node, ProcessIdentity.of_this_process(), time.time())

    def to_json(self) -> str:
        return json.dumps({"node": self.node, "process": self.process.to_json(), "started": self.started})

    @classmethod
    def from_json(cls, incarnation_id: str, raw: str) -> Incarnation:
        try:
            data = json.loads(raw)
            return cls(incarnation_id, str(data["node"]), ProcessIdentity.from_json(data.get("process") or {}),
                       float(data.get("started", 0)))
        except (ValueError, KeyError, TypeError, AttributeError):
            return cls(incarnation_id, incarnation_id, ProcessIdentity("", "", "", 0, ""), 0.0)

    def describe(self) -> str:
        return f"{self.node} ({self.process.describe()}, incarnation {self.id[:8]})"


@dataclass(frozen=True)
class HeldMessage:
    node: str
    task_id: str
    tag: str
    queue: str
    shard_id: str
    # When the incarnation was last heard of (its last heartbeat), and how long its heartbeat outlives that.
    last_seen: float
    ttl_s: float
    incarnation: str = ""

    def back_by(self) -> float:
        """When a live worker will have put it back, at the latest: the heartbeat expired, and one more beat."""
        return self.last_seen + self.ttl_s * 4 / 3


class Liveness:
    """The incarnations, heartbeats and held messages of a run's workers, in Redis."""

    def __init__(self, client: Any, run_name: str, ttl_s: int) -> None:
        self.client = client  # decode_responses=True
        self.keys = RunKeys(run_name)
        self.ttl_s = ttl_s

    def register(self, incarnation: Incarnation) -> None:
        """A worker process starting: recorded, with its first heartbeat."""
        self.client.hset(self.keys.incarnations, incarnation.id, incarnation.to_json())
        self.beat(incarnation.id)

    def beat(self, incarnation: str, *, now: float | None = None) -> None:
        now = time.time() if now is None else now
        pipe = self.client.pipeline()
        pipe.set(self.keys.alive(incarnation), repr(now), ex=self.ttl_s)
        pipe.hset(self.keys.last_seen, incarnation, repr(now))
        pipe.execute()

    def took(self, incarnation: str, task_id: str, tag: str, queue: str, shard_id: str) -> None:
        self.client.hset(
            self.keys.held(incarnation), task_id, json.dumps({"tag": tag, "queue": queue, "shard": shard_id})
        )

    def done(self, incarnation: str, task_id: str) -> None:
        self.client.hdel(self.keys.held(incarnation), task_id)

    def leave(self, incarnation: str) -> None:
        """A worker stopping warmly (its messages go back by kombu's own hand), or a dead incarnation whose messages
        were put back: none of its records is left."""
        pipe = self.client.pipeline()
        pipe.delete(self.keys.alive(incarnation), self.keys.held(incarnation))
        pipe.hdel(self.keys.incarnations, incarnation)
        pipe.hdel(self.keys.last_seen, incarnation)
        pipe.execute()

    def incarnations(self) -> dict[str, Incarnation]:
        """Every registered incarnation, live or dead, and any that holds records without being registered."""
        found = {i: Incarnation.from_json(i, raw) for i, raw in self.client.hgetall(self.keys.incarnations).items()}
        for key in self.client.scan_iter(match=self.keys.held_prefix + "*", count=1000):
            incarnation = key[len(self.keys.held_prefix) :]
            found.setdefault(incarnation, Incarnation.from_json(incarnation, "{}"))
        return found

    def heartbeat_fresh(self, incarnation: str) -> bool:
        return bool(self.client.exists(self.keys.alive(incarnation)))

    def is_dead(self, incarnation: Incarnation) -> bool:
        """Its heartbeat expired, or its process is seen gone."""
        return not self.heartbeat_fresh(incarnation.id) or incarnation.process.running() is False

    def any_alive(self) -> bool:
        """Whether some worker of the run beats (and so puts back what dead ones held)."""
        return any(not self.is_dead(i) for i in self.incarnations().values())

    def dead(self) -> list[Incarnation]:
        return [i for i in self.incarnations().values() if self.is_dead(i)]

    def namesakes(self, incarnation: Incarnation) -> list[Incarnation]:
        """The other incarnations registered under `incarnation`'s node name, live or dead."""
        return [i for i in self.incarnations().values() if i.node == incarnation.node and i.id != incarnation.id]

    def predecessors(self, successor: Incarnation) -> list[Incarnation]:
        """Earlier incarnations under `successor`'s node name that are dead, as far as this process can tell: the
        successor puts back what they held. Their process seen gone, or out of sight (another host, boot or pid
        namespace) with its heartbeat expired. One seen running is left to its heartbeat."""
        return [i for i in self.namesakes(successor) if self._gone(i)]

    def _gone(self, incarnation: Incarnation) -> bool:
        running = incarnation.process.running()
        return running is False or (running is None and not self.heartbeat_fresh(incarnation.id))

    def live_namesakes(self, incarnation: Incarnation) -> list[Incarnation]:
        """Other incarnations under `incarnation`'s node name that are alive: heartbeat fresh, and their process
        running or out of sight from here."""
        return [
            i for i in self.namesakes(incarnation)
            if self.heartbeat_fresh(i.id) and i.process.running() is not False
        ]

    def last_seen(self, incarnation: str) -> float | None:
        """When the incarnation last beat (wall clock), None when it never did."""
        seen = self.client.hget(self.keys.last_seen, incarnation)
        return float(seen) if seen is not None else None

    def held(self) -> list[HeldMessage]:
        """Every message a worker recorded taking and has not finished, whatever its heartbeat."""
        return self.held_by(list(self.incarnations().values()))

    def held_by_dead(self) -> list[HeldMessage]:
        """Messages recorded by incarnations that are dead."""
        return self.held_by(self.dead())

    def held_by(self, incarnations: list[Incarnation]) -> list[HeldMessage]:
        held = []
        seen = self.client.hgetall(self.keys.last_seen)
        for incarnation in incarnations:
            for task_id, raw in self.client.hgetall(self.keys.held(incarnation.id)).items():
                fields = json.loads(raw)
                held.append(
                    HeldMessage(
                        incarnation.node, task_id, fields["tag"], fields["queue"], fields["shard"],
                        float(seen.get(incarnation.id, 0)), self.ttl_s, incarnation.id,
                    )
                )
        return held
