"""The reference audit's bookkeeping in the run's broker: which extract worker process (incarnation) stored each
shard and in which order, which of its shards are sent to the audit lane, their verdicts, the workers an audit
halted, and the shards that became suspect.

An extract incarnation's first stored shard is audited, then one in `every_shards`, and at least one every
`every_minutes` (`record_stored` decides, atomically with the count). An audit that fails halts its incarnation
(the worker stops: queue/audit_halt.py) and makes suspect every shard it stored after its last passed audit that
precedes the failing shard (the failing shard itself, and all it stored since): those could hold the same fault. A
shard stored by a halted incarnation is suspect at once. Both happen in one Lua script each, so a shard stored
while the audit fails is suspect either way. A suspect record names who had consumed the shard by then (the live
dataset's acknowledgements), the shards a trainer was served before the fault was found.

Storage keeps its own mark of each suspect shard (shards/suspects.py), which the readers check; this is what
`status`, `verify` and `dflash-queue suspects` read and what decides which shards a halted worker leaves suspect.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from dflash_queue.runstate.keys import RunKeys

# KEYS: sequence, worker hash, stored zset, shards hash, suspects hash.
# ARGV: member, stored record (JSON), now, every_shards, every_s, node.
# Returns {position, due (0/1), halted reason ("" when not halted)}.
_RECORD_STORED = """
local position = redis.call('INCR', KEYS[1])
redis.call('ZADD', KEYS[3], position, ARGV[1])
local record = cjson.decode(ARGV[2])
record['position'] = position
redis.call('HSET', KEYS[4], ARGV[1], cjson.encode(record))
redis.call('HSETNX', KEYS[2], 'node', ARGV[6])
local halted = redis.call('HGET', KEYS[2], 'halted')
if halted then
  local suspect = {shard = record['shard'], epoch = record['epoch'], incarnation = record['incarnation'],
                   node = record['node'], reason = halted, audited = '', time = tonumber(ARGV[3]), consumed_by = {}}
  redis.call('HSET', KEYS[5], ARGV[1], cjson.encode(suspect))
  return {position, 0, halted}
end
local since = redis.call('HINCRBY', KEYS[2], 'since', 1)
local last = tonumber(redis.call('HGET', KEYS[2], 'last_sent') or '-1')
local every_s = tonumber(ARGV[5])
local due = last < 0 or since >= tonumber(ARGV[4]) or (every_s > 0 and tonumber(ARGV[3]) - last >= every_s)
if due then
  redis.call('HSET', KEYS[2], 'since', 0, 'last_sent', ARGV[3])
  return {position, 1, ''}
end
return {position, 0, ''}
"""

# KEYS: worker hash, stored zset, passed zset, suspects hash.
# ARGV: failing member, its position, reason, now, suspect template (JSON: audited, and the fields every record
# shares). Returns the members made suspect now (JSON list).
_RECORD_FAILED = """
redis.call('HSETNX', KEYS[1], 'halted', ARGV[3])
local failing = tonumber(ARGV[2])
local before = redis.call('ZREVRANGEBYSCORE', KEYS[3], '(' .. failing, '-inf', 'WITHSCORES', 'LIMIT', 0, 1)
local after = '-inf'
if #before > 0 then after = '(' .. before[2] end
local members = redis.call('ZRANGEBYSCORE', KEYS[2], after, '+inf')
local made = {}
for _, member in ipairs(members) do
  if redis.call('HEXISTS', KEYS[4], member) == 0 then
    local suspect = cjson.decode(ARGV[5])
    local colon = string.find(member, ':', 1, true)
    suspect['epoch'] = tonumber(string.sub(member, 1, colon - 1))
    suspect['shard'] = string.sub(member, colon + 1)
    redis.call('HSET', KEYS[4], member, cjson.encode(suspect))
    table.insert(made, member)
  end
end
return cjson.encode(made)
"""


def member(shard_id: str, epoch: int) -> str:
    return f"{epoch}:{shard_id}"


def split_member(text: str) -> tuple[str, int]:
    epoch, _, shard_id = text.partition(":")
    return shard_id, int(epoch)


@dataclass(frozen=True)
class StoredShard:
    """Who stored a shard, in which order, and what its audit said."""

    shard: str
    epoch: int
    incarnation: str
    node: str
    position: int
    time: float
    dtype: str = ""  # what the engine computed in ("bfloat16"), as the worker that stored it said
    verdict: str = ""  # "", "passed" or "failed"
    detail: str = ""


@dataclass(frozen=True)
class StoreVerdict:
    position: int
    audit_due: bool
    halted: str  # why the incarnation that stored it was halted ("": it was not): the shard is suspect


@dataclass(frozen=True)
class Suspect:
    shard: str
    epoch: int
    incarnation: str  # the extract worker process that stored it
    node: str
    reason: str  # the failed audit that made it suspect
    audited: str  # the shard whose audit failed ("" when it was stored after its worker was halted)
    time: float
    # Consumers that had acknowledged the shard when it turned suspect: a trainer was served it as good.
    consumed_by: list[str] = field(default_factory=list)

    @classmethod
    def from_json(cls, text: str) -> Suspect:
        raw = json.loads(text)
        consumed = raw.get("consumed_by") or []
        return cls(
            shard=str(raw.get("shard", "")),
            epoch=int(raw.get("epoch", 0)),
            incarnation=str(raw.get("incarnation", "")),
            node=str(raw.get("node", "")),
            reason=str(raw.get("reason", "")),
            audited=str(raw.get("audited", "")),
            time=float(raw.get("time", 0.0)),
            consumed_by=list(consumed) if isinstance(consumed, list) else [],
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self))


class AuditRecords:
    """The audit's state of one run, in Redis (a client made with decode_responses=True)."""

    def __init__(self, client: Any, run_name: str) -> None:
        self.client = client
        self.keys = RunKeys(run_name)
        self._stored = client.register_script(_RECORD_STORED)
        self._failed = client.register_script(_RECORD_FAILED)

    def record_stored(
        self,
        shard_id: str,
        epoch: int,
        incarnation: str,
        node: str,
        *,
        every_shards: int,
        every_s: float,
        dtype: str = "",
        now: float | None = None,
    ) -> StoreVerdict:
        """An extract incarnation stored a shard (its engine computing in `dtype`): its store position, whether its
        audit is due, and whether the incarnation was halted (the shard is then suspect already)."""
        now = time.time() if now is None else now
        record = {"shard": shard_id, "epoch": epoch, "incarnation": incarnation, "node": node, "time": now,
                  "dtype": dtype}
        keys = self.keys
        position, due, halted = self._stored(
            keys=[keys.audit_sequence, keys.audit_worker(incarnation), keys.audit_stored(incarnation),
                  keys.audit_shards, keys.suspects],
            args=[member(shard_id, epoch), json.dumps(record), repr(now), every_shards, repr(every_s), node],
        )
        return StoreVerdict(int(position), bool(int(due)), str(halted or ""))

    def stored_shard(self, shard_id: str, epoch: int) -> StoredShard | None:
        text = self.client.hget(self.keys.audit_shards, member(shard_id, epoch))
        if not text:
            return None
        raw = json.loads(text)
        return StoredShard(
            shard=shard_id, epoch=epoch, incarnation=str(raw.get("incarnation", "")), node=str(raw.get("node", "")),
            position=int(raw.get("position", 0)), time=float(raw.get("time", 0.0)), dtype=str(raw.get("dtype", "")),
            verdict=str(raw.get("verdict", "")), detail=str(raw.get("detail", "")),
        )

    def record_passed(self, stored: StoredShard, detail: str) -> None:
        key = member(stored.shard, stored.epoch)
        pipe = self.client.pipeline()
        pipe.zadd(self.keys.audit_passed(stored.incarnation), {key: stored.position})
        pipe.hset(self.keys.audit_shards, key, self._with_verdict(stored, "passed", detail))
        pipe.execute()

    def record_failed(self, stored: StoredShard, reason: str, now: float | None = None) -> list[Suspect]:
        """The audit of `stored` failed: its incarnation is halted, and the shards it stored after its last passed
        audit before `stored` (`stored` included, and all it stored since) become suspect; returns those that
        became suspect now."""
        now = time.time() if now is None else now
        keys = self.keys
        self.client.hset(keys.audit_shards, member(stored.shard, stored.epoch),
                         self._with_verdict(stored, "failed", reason))
        template = {"incarnation": stored.incarnation, "node": stored.node, "reason": reason,
                    "audited": stored.shard, "time": now, "consumed_by": []}
        made = json.loads(self._failed(
            keys=[keys.audit_worker(stored.incarnation), keys.audit_stored(stored.incarnation),
                  keys.audit_passed(stored.incarnation), keys.suspects],
            args=[member(stored.shard, stored.epoch), stored.position, reason, repr(now), json.dumps(template)],
        ) or "[]")
        return [
            Suspect(shard_id, epoch, stored.incarnation, stored.node, reason, stored.shard, now)
            for shard_id, epoch in map(split_member, made)
        ]

    def add_suspect(self, suspect: Suspect, now: float | None = None) -> Suspect:
        """A shard made suspect outside a worker's record (its storing worker unknown to the broker)."""
        if not suspect.time:
            suspect = Suspect(**{**asdict(suspect), "time": time.time() if now is None else now})
        self.client.hset(self.keys.suspects, member(suspect.shard, suspect.epoch), suspect.to_json())
        return suspect

    def note_consumed(self, suspect: Suspect, consumers: list[str]) -> Suspect:
        """Record who had consumed a shard when it turned suspect (the live dataset's acknowledgements)."""
        noted = Suspect(**{**asdict(suspect), "consumed_by": sorted(consumers)})
        self.client.hset(self.keys.suspects, member(suspect.shard, suspect.epoch), noted.to_json())
        return noted

    def halted(self, incarnation: str) -> str:
        """Why an audit halted this incarnation ("" when none did)."""
        return str(self.client.hget(self.keys.audit_worker(incarnation), "halted") or "")

    def suspects(self) -> list[Suspect]:
        """Every suspect shard, oldest first."""
        found = []
        for key, text in (self.client.hgetall(self.keys.suspects) or {}).items():
            try:
                found.append(Suspect.from_json(text))
            except (ValueError, TypeError):
                shard_id, epoch = split_member(key)
                found.append(Suspect(shard_id, epoch, "?", "?", f"unreadable suspect record: {text[:200]!r}", "", 0.0))
        return sorted(found, key=lambda s: (s.time, s.epoch, s.shard))

    def is_suspect(self, shard_id: str, epoch: int) -> bool:
        return bool(self.client.hexists(self.keys.suspects, member(shard_id, epoch)))

    def clear_suspect(self, shard_id: str, epoch: int) -> bool:
        """The shard was stored again (extracted anew): no longer suspect. Whether it was."""
        return bool(self.client.hdel(self.keys.suspects, member(shard_id, epoch)))

    @staticmethod
    def _with_verdict(stored: StoredShard, verdict: str, detail: str) -> str:
        return json.dumps({**asdict(stored), "verdict": verdict, "detail": detail})
