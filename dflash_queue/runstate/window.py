"""A live dataset's window in Redis (`ShardWindow`): the window of shards stored but not yet consumed, who reads a
run's training shards while it extracts, what they acknowledged, and the epochs.

* An epoch is a set of shards (shard id -> samples), recorded once when it is sealed: epoch 0 by the producer
  (every shard of the dataset), a later one when its extraction is enqueued (`dflash_queue.live.epochs`).
  Epoch 0's shard states are the ledger's; a later epoch's are kept here.
* A consumer (a training job, several ranks) registers by name; each of its ranks acknowledges the shards it
  consumed, per epoch. The acknowledged sets are the consumer's cursor: a restarted rank skips them.
* The window (extract.max_unconsumed_shards): a shard takes a place before it is extracted and gives it back
  once every registered consumer acknowledged it (or its extraction failed for good). A place is held per
  (epoch, shard), so a re-delivered task takes the place it already holds. A place is given back only after
  what shows the shard stored or consumed is in storage (the training file, or the record a deleted one leaves):
  a second delivery of a shard's task that takes a place anew looks again, and gives it back at once if so.
  A shard every registered consumer has acknowledged takes no place when it is extracted again (a requeued or
  suspect shard's redo): no consumer would read it, so the place would never be given back. Nor does a shard of an
  epoch every registered consumer has left (each of its ranks seen in a later epoch, or finished): a shard that
  failed for good, left out of its epoch and requeued after it, is stored, but no rank reads it there.
* A suspect shard (runstate/audits.py) is not read until it is extracted again. The rank whose shard it is gives
  its place back (`live.LiveShards`), so that suspect shards never fill the window while they wait; its
  re-extraction takes a place anew, and keeps the shard's first position in the store order (the same rank serves
  it once it is stored again).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

import redis

from dflash_queue.runstate.keys import RunKeys
from dflash_queue.runstate.ledger import Ledger, resilient_client
from dflash_queue.runstate.shard_states import DONE, FAILED

# What take_place answers when it gives a place: the shard holds one already, or it took one now.
HELD = 1
TAKEN = 2

# A rank that has not polled for this long is shown as silent by `status`.
SILENT_AFTER_S = 120.0


class ShardWindow:
    def __init__(self, client: redis.Redis, run_name: str) -> None:
        self.client: Any = client  # made with decode_responses=True
        self.keys = RunKeys(run_name)
        self.window_key = self.keys.window
        self.consumers_key = self.keys.consumers
        self.waiting_key = self.keys.waiting

    @classmethod
    def from_url(cls, url: str, run_name: str) -> ShardWindow:
        return cls(resilient_client(url), run_name)

    # -- epochs

    def seal_epoch(self, epoch: int, sizes: dict[str, int]) -> None:
        """Record the epoch's shards (added to any recorded before) and mark it sealed."""
        pipe = self.client.pipeline()
        if sizes:
            pipe.hset(self.keys.epoch_shards(epoch), mapping=sizes)
        pipe.set(self.keys.epoch_sealed(epoch), repr(time.time()), nx=True)
        pipe.execute()

    def epoch_shards(self, epoch: int) -> dict[str, int] | None:
        """shard id -> samples of a sealed epoch; None while it is not."""
        pipe = self.client.pipeline(transaction=False)
        pipe.exists(self.keys.epoch_sealed(epoch))
        pipe.hgetall(self.keys.epoch_shards(epoch))
        sealed, shards = pipe.execute()
        return {shard: int(n) for shard, n in shards.items()} if sealed else None

    def claim_epoch(self, epoch: int) -> bool:
        """Whether this caller is the one to enqueue the epoch's extraction (once per epoch)."""
        return bool(self.client.set(self.keys.epoch_claimed(epoch), repr(time.time()), nx=True))

    def unclaim_epoch(self, epoch: int) -> None:
        self.client.delete(self.keys.epoch_claimed(epoch))

    def last_epoch(self) -> int:
        """The latest sealed epoch (0 before any is)."""
        epoch = 0
        while self.client.exists(self.keys.epoch_sealed(epoch + 1)):
            epoch += 1
        return epoch

    def record_stored(self, epoch: int, shard_id: str) -> int:
        """The shard's position in the order its epoch's shards were stored, given once (a shard stored twice keeps
        its first). Ranks take shards by position, round robin: whichever shard is stored next goes to the next
        rank, so no rank waits on a shard while the window is full of the others'."""
        return int(self.client.eval(_RECORD_STORED, 2, self.keys.epoch_stored(epoch), self.keys.epoch_stored_count(epoch), shard_id))

    def stored_since(self, epoch: int, position: int) -> list[tuple[str, int]]:
        """(shard id, position) of the epoch's shards stored at `position` and after, in order."""
        found = self.client.zrange(self.keys.epoch_stored(epoch), position, "+inf", byscore=True, withscores=True)
        return [(shard_id, int(score)) for shard_id, score in found]

    def set_epoch_state(self, epoch: int, shard_id: str, state: str, error: str = "") -> None:
        """A later epoch's shard state (epoch 0's are the ledger's)."""
        pipe = self.client.pipeline()
        pipe.hset(self.keys.epoch_states(epoch), shard_id, state)
        if error:
            pipe.hset(self.keys.epoch_failures(epoch), shard_id, error)
        pipe.execute()

    def epoch_states(self, epoch: int) -> dict[str, str]:
        return self.client.hgetall(self.keys.epoch_states(epoch))

    # -- consumers

    def register(self, consumer: str, *, world_size: int, seed: int) -> None:
        """Record a consumer, or check that it is the one recorded under that name: its shards are split by world
        size and seed, and a restart must split them the same way."""
        mine = {"world_size": world_size, "seed": seed}
        recorded = self.client.hget(self.consumers_key, consumer)
        if recorded is None:
            self.client.hsetnx(self.consumers_key, consumer, json.dumps({**mine, "since": time.time()}))
            recorded = self.client.hget(self.consumers_key, consumer)
        fields = json.loads(recorded)
        differs = {k: (fields.get(k), v) for k, v in mine.items() if fields.get(k) != v}
        if differs:
            said = ", ".join(f"{k} {was} (now {now})" for k, (was, now) in differs.items())
            raise ValueError(
                f"consumer {consumer!r} was registered with {said}: its acknowledged shards were split that way; "
                "use another consumer name for another split"
            )

    def consumers(self) -> dict[str, dict[str, Any]]:
        return {name: json.loads(fields) for name, fields in self.client.hgetall(self.consumers_key).items()}

    def want_epochs(self, consumer: str, epochs: int) -> None:
        """How many epochs the consumer trains (the most any of its processes asked for): `dflash-queue run`
        stays up, extracting them, until the consumer has consumed them."""
        self.client.eval(_AT_LEAST, 1, self.keys.epochs_wanted, consumer, epochs)

    def epochs_wanted(self) -> dict[str, int]:
        return {name: int(n) for name, n in self.client.hgetall(self.keys.epochs_wanted).items()}

    def part_finished(self, consumer: str, rank: int, part: tuple[int, int]) -> None:
        """One reader of a rank (the rank itself, or one of its DataLoader workers: `part`) served its last epoch."""
        index, count = part
        self.client.hset(self.keys.readers_finished(consumer), f"{rank}:{index}", str(count))

    def ranks_finished(self, consumer: str) -> set[int]:
        """Ranks of the consumer every reader of which served its last epoch."""
        parts: dict[int, dict[int, int]] = {}
        for field, count in self.client.hgetall(self.keys.readers_finished(consumer)).items():
            rank, _, index = field.partition(":")
            parts.setdefault(int(rank), {})[int(index)] = int(count)
        return {rank for rank, found in parts.items() if set(found) >= set(range(max(found.values())))}

    def to_go(self, ledger: Ledger) -> dict[str, str]:
        """consumer -> what it still has to do, for each registered consumer that wants epochs not yet all
        extracted, acknowledged and finished by every one of its ranks (with the places of its shards given back)."""
        found = {}
        consumers = self.consumers()
        for name, epochs in sorted(self.epochs_wanted().items()):
            if name not in consumers:
                continue
            world_size = int(consumers[name].get("world_size", 1))
            for epoch in range(epochs):
                shards = self.epoch_shards(epoch)
                if shards is None:
                    found[name] = f"epoch {epoch} of {epochs} not started"
                    break
                states = epoch_states(self, ledger, epoch, list(shards))
                unsettled = [s for s in shards if not settled(states.get(s))]
                if unsettled:
                    found[name] = f"epoch {epoch}: {len(unsettled)} of {len(shards)} shards not extracted yet"
                    break
                if self.left_epoch(name, epoch):  # what is stored there since (a requeued shard) is not read
                    continue
                acknowledged = self.acknowledged(name, epoch)
                unread = [s for s in shards if states.get(s) == DONE and s not in acknowledged]
                held = self.places_held(epoch, list(shards))
                if unread or held:
                    found[name] = f"epoch {epoch}: {len(unread) or len(held)} of {len(shards)} shards not consumed yet"
                    break
            else:
                finished = self.ranks_finished(name)
                if len(finished) < world_size:
                    found[name] = f"{len(finished)} of {world_size} ranks finished"
        return found

    def left_epoch(self, consumer: str, epoch: int) -> bool:
        """Whether every rank of the consumer has left `epoch`: seen in a later one, or finished its last epoch (one
        at or after `epoch`). A rank leaves an epoch once its shards of it are consumed and the rest stored or failed
        for good, so a shard of the epoch stored after that (a failed one requeued) is read by none of them."""
        fields = self.consumers().get(consumer)
        if fields is None:
            return False
        seen = self.ranks_seen(consumer)
        finished = self.ranks_finished(consumer) if epoch < self.epochs_wanted().get(consumer, 0) else set()
        return all(
            rank in finished or int(seen.get(rank, {}).get("epoch", -1)) > epoch
            for rank in range(int(fields.get("world_size", 1)))
        )

    def seen(self, consumer: str, rank: int, epoch: int) -> None:
        """A rank's heartbeat: when it last looked for shards, and in which epoch."""
        self.client.hset(self.keys.ranks_seen(consumer), str(rank), json.dumps({"at": time.time(), "epoch": epoch}))

    def ranks_seen(self, consumer: str) -> dict[int, dict[str, float]]:
        return {int(r): json.loads(v) for r, v in self.client.hgetall(self.keys.ranks_seen(consumer)).items()}

    def acknowledge(self, consumer: str, epoch: int, shard_id: str) -> bool:
        """Record the shard consumed by `consumer`; returns whether every registered consumer now has it."""
        self.client.sadd(self.keys.acknowledged(consumer, epoch), shard_id)
        return self.everyone_acknowledged(epoch, shard_id)

    def everyone_acknowledged(self, epoch: int, shard_id: str) -> bool:
        names = self.client.hkeys(self.consumers_key)
        check = self.client.pipeline(transaction=False)
        for name in names:
            check.sismember(self.keys.acknowledged(name, epoch), shard_id)
        return bool(names) and all(check.execute())

    def acknowledged(self, consumer: str, epoch: int) -> set[str]:
        return self.client.smembers(self.keys.acknowledged(consumer, epoch))

    # -- the window

    @staticmethod
    def _place(epoch: int, shard_id: str) -> str:
        return f"{epoch}:{shard_id}"

    def take_place(self, epoch: int, shard_id: str, size: int) -> int:
        """A place in a window of `size` for the shard: TAKEN (it had none), HELD (it already holds one: another
        delivery of its task took it), or 0 when the window is full. A shard every registered consumer has
        acknowledged (extracted again after they read it) is answered TAKEN without a place: none would be given
        back, as no consumer reads it again; the caller's second look (is it stored?) stays as it was. So is a shard of
        an epoch every registered consumer has left (`left_epoch`), and a place it holds is given back."""
        consumers = list(self.client.hkeys(self.consumers_key))
        acknowledged = [self.keys.acknowledged(name, epoch) for name in consumers]
        left = bool(consumers) and all(self.left_epoch(name, epoch) for name in consumers)
        return int(self.client.eval(
            _TAKE_PLACE, 2 + len(acknowledged), self.window_key, self.consumers_key, *acknowledged,
            self._place(epoch, shard_id), size, shard_id, int(left),
        ))

    def give_back_place(self, epoch: int, shard_id: str) -> None:
        self.client.srem(self.window_key, self._place(epoch, shard_id))

    def places_held(self, epoch: int, shard_ids: Sequence[str]) -> set[str]:
        ids = list(shard_ids)
        if not ids:
            return set()
        held = self.client.smismember(self.window_key, [self._place(epoch, s) for s in ids])
        return {s for s, member in zip(ids, held, strict=True) if member}

    def places(self) -> list[tuple[int, str]]:
        """(epoch, shard id) of every place held in the window."""
        held = [place.split(":", 1) for place in self.client.smembers(self.window_key)]
        return sorted((int(epoch), shard_id) for epoch, shard_id in held)

    def window_fill(self) -> int:
        return int(self.client.scard(self.window_key))

    def note_waiting(self, epoch: int, shard_id: str, ttl_s: int) -> None:
        """An extract task waits for a place: `status` says so while this lasts."""
        self.client.set(self.waiting_key, json.dumps({"epoch": epoch, "shard": shard_id, "at": time.time()}), ex=ttl_s)

    def waiting(self) -> dict[str, Any] | None:
        raw = self.client.get(self.waiting_key)
        return json.loads(raw) if raw else None


def epoch_states(consumption: ShardWindow, ledger: Ledger, epoch: int, shard_ids: Sequence[str]) -> dict[str, str]:
    """Where each shard of the epoch stands (epoch 0: the run's ledger)."""
    if epoch == 0:
        return ledger.states(shard_ids)
    states = consumption.epoch_states(epoch)
    return {s: states[s] for s in shard_ids if s in states}


def settled(state: str | None) -> bool:
    """A shard whose extraction is over: stored, or failed for good."""
    return state in (DONE, FAILED)


_RECORD_STORED = """
local known = redis.call('ZSCORE', KEYS[1], ARGV[1])
if known then return tonumber(known) end
local position = redis.call('INCR', KEYS[2]) - 1
redis.call('ZADD', KEYS[1], position, ARGV[1])
return position
"""

_AT_LEAST = """
local known = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
if tonumber(ARGV[2]) > known then redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) end
return 1
"""

# KEYS: window, consumers hash, each registered consumer's acknowledged set of the epoch (as read just before: a
# consumer registered since makes the count differ, and the shard takes a place as any other).
# ARGV: place, window size, shard id, 1 when every consumer read just before has left the epoch.
_TAKE_PLACE = """
if ARGV[4] == '1' and redis.call('HLEN', KEYS[2]) == #KEYS - 2 then
  redis.call('SREM', KEYS[1], ARGV[1])
  return 2
end
if redis.call('SISMEMBER', KEYS[1], ARGV[1]) == 1 then return 1 end
if #KEYS > 2 and redis.call('HLEN', KEYS[2]) == #KEYS - 2 then
  local everyone = true
  for i = 3, #KEYS do
    if redis.call('SISMEMBER', KEYS[i], ARGV[3]) == 0 then everyone = false break end
  end
  if everyone then return 2 end
end
if redis.call('SCARD', KEYS[1]) < tonumber(ARGV[2]) then
  redis.call('SADD', KEYS[1], ARGV[1])
  return 2
end
return 0
"""
