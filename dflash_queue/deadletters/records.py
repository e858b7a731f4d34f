"""Dead letters: one record in Redis per unit of work that failed for good, kept until an operator acts.

A unit is a whole task (a shard that failed permanently, ran out of retries, or was delivered more than
`broker.max_deliveries` times), one sample that a lane isolated as the cause of a failure (a poison sample),
or a message that could not be run at all (bad JSON, unknown task, wrong arguments).

Records are keyed by what failed, so a unit that fails again updates its record (last failure time, count)
instead of adding a second one. `take` removes records atomically: of two operators requeueing the same
record, exactly one gets it.
"""

from __future__ import annotations

import json
import time
import traceback as tb
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TypedDict

import redis

from dflash_queue import jsoncodec
from dflash_queue.lanes.registry import UNKNOWN_LANE
from dflash_queue.runstate.keys import RunKeys

# Kinds of record.
TASK = "task"
SAMPLE = "sample"
MESSAGE = "message"

# Fields kept from an exception's traceback; the head of a long traceback says little.
TRACEBACK_CHARS = 8000


@dataclass(frozen=True)
class DeadLetter:
    id: str
    kind: str
    lane: str
    task: str
    shard_id: str = ""
    args: list = field(default_factory=list)
    kwargs: dict = field(default_factory=dict)
    sample_ids: list[str] = field(default_factory=list)
    exc_type: str = ""
    message: str = ""
    traceback: str = ""
    deliveries: int = 0
    worker: str = ""
    first_failed: float = 0.0
    last_failed: float = 0.0
    failures: int = 1

    @property
    def requeueable(self) -> bool:
        """A message that could not be decoded or names no known task has nothing to send again."""
        return self.kind != MESSAGE

    def to_json(self) -> str:
        data = asdict(self)
        try:
            return jsoncodec.dumps(data, sort_keys=True).decode()
        except UnicodeEncodeError:  # a lone surrogate (undecodable bytes in an error message) kept as an escape
            return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> DeadLetter:
        return cls(**jsoncodec.loads(text))

    def summary(self) -> str:
        what = self.shard_id or "-"
        if self.kind == SAMPLE:
            what += f" sample {','.join(self.sample_ids)}"
        return f"{self.id}  {self.lane:<8} {self.kind:<7} {what}  {self.exc_type}: {self.message[:120]}"


def record_id(kind: str, lane: str, shard_id: str = "", sample_ids: Sequence[str] = (), task_id: str = "") -> str:
    """What failed, as a key: the same unit failing again lands on the same record."""
    if kind == TASK:
        return f"{lane}:{shard_id}"
    if kind == SAMPLE:
        return f"{lane}:{shard_id}:{','.join(sample_ids)}"
    return f"{lane or UNKNOWN_LANE}:message:{task_id}"


class ExceptionFields(TypedDict):
    exc_type: str
    message: str
    traceback: str


def exception_fields(exc: BaseException) -> ExceptionFields:
    text = "".join(tb.format_exception(type(exc), exc, exc.__traceback__))
    return {"exc_type": type(exc).__name__, "message": str(exc), "traceback": text[-TRACEBACK_CHARS:]}


@dataclass(frozen=True)
class Filter:
    lane: str | None = None
    exc_type: str | None = None
    kind: str | None = None
    # Only records whose last failure is at least this old / at most this old (seconds).
    older_than_s: float | None = None
    newer_than_s: float | None = None

    def matches(self, record: DeadLetter, now: float) -> bool:
        age = now - record.last_failed
        return (
            (self.lane is None or record.lane == self.lane)
            and (self.exc_type is None or record.exc_type == self.exc_type)
            and (self.kind is None or record.kind == self.kind)
            and (self.older_than_s is None or age >= self.older_than_s)
            and (self.newer_than_s is None or age <= self.newer_than_s)
        )


# Remove and return a field only if it is there: the atomic half of a requeue.
_TAKE = """
local value = redis.call('HGET', KEYS[1], ARGV[1])
if value then redis.call('HDEL', KEYS[1], ARGV[1]) end
return value
"""


class DeadLetters:
    def __init__(self, client: redis.Redis, run_name: str) -> None:
        self.client = client
        self.key = RunKeys(run_name).dead_letters
        self._take = client.register_script(_TAKE)

    @classmethod
    def from_url(cls, url: str, run_name: str) -> DeadLetters:
        from dflash_queue.runstate.ledger import resilient_client

        return cls(resilient_client(url), run_name)

    def add(self, record: DeadLetter, *, now: float | None = None) -> DeadLetter:
        """Store a failure; a unit that already has a record keeps its first failure time and counts on."""
        now = time.time() if now is None else now
        with self.client.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(self.key)
                    existing = pipe.hget(self.key, record.id)
                    if existing:
                        previous = DeadLetter.from_json(existing)
                        record = replace(
                            record, first_failed=previous.first_failed, failures=previous.failures + 1, last_failed=now
                        )
                    else:
                        record = replace(record, first_failed=now, last_failed=now, failures=1)
                    pipe.multi()
                    pipe.hset(self.key, record.id, record.to_json())
                    pipe.execute()
                    return record
                except redis.WatchError:
                    continue

    def get(self, record_id: str) -> DeadLetter | None:
        value = self.client.hget(self.key, record_id)
        return DeadLetter.from_json(value) if value else None

    def all(self) -> list[DeadLetter]:
        records = [DeadLetter.from_json(v) for v in self.client.hvals(self.key)]
        return sorted(records, key=lambda r: (r.first_failed, r.id))

    def select(self, where: Filter = Filter(), ids: Iterable[str] = (), *, now: float | None = None) -> list[DeadLetter]:
        now = time.time() if now is None else now
        wanted = set(ids)
        return [r for r in self.all() if (not wanted or r.id in wanted) and where.matches(r, now)]

    def take(self, record_id: str) -> DeadLetter | None:
        """Remove the record and return it, or None when it is gone (someone else took or purged it)."""
        value = self._take(keys=[self.key], args=[record_id])
        return DeadLetter.from_json(value) if value else None

    def put_back(self, record: DeadLetter) -> None:
        """Undo a `take` whose requeue could not be sent."""
        self.client.hsetnx(self.key, record.id, record.to_json())

    def settle(self, lane: str, shard_id: str) -> bool:
        """A shard's task succeeded after all (a rebuild re-sent it, say): its task record is stale."""
        return bool(self.client.hdel(self.key, record_id(TASK, lane, shard_id)))

    def remove(self, record_ids: Iterable[str]) -> int:
        ids = list(record_ids)
        return int(self.client.hdel(self.key, *ids)) if ids else 0

    def count(self) -> int:
        return int(self.client.hlen(self.key))
