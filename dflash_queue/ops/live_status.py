"""What `status` shows of a run trained while it extracts: the epoch, the window's fill, the consumers and their lag,
and why extraction waits when it does."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import redis

from dflash_queue.runstate.ledger import Ledger
from dflash_queue.runstate.shard_states import DONE, FAILED
from dflash_queue.runstate.window import SILENT_AFTER_S, ShardWindow, epoch_states


@dataclass
class ConsumerStatus:
    name: str
    world_size: int
    epoch: int  # the latest epoch any of its ranks was seen in
    acknowledged: int  # shards of that epoch it consumed
    lag: int  # shards of that epoch stored (or consumed by others) that it has not acknowledged
    # rank -> seconds since it last looked for shards
    ranks_seen_s: dict[int, float] = field(default_factory=dict)

    @property
    def silent_ranks(self) -> list[int]:
        return [rank for rank, age in sorted(self.ranks_seen_s.items()) if age > SILENT_AFTER_S]


@dataclass
class LiveStatus:
    epoch: int  # the latest epoch started
    epoch_shards: int
    epoch_done: int
    epoch_failed: int
    window_size: int  # extract.max_unconsumed_shards (0: no window)
    window_fill: int
    consumers: list[ConsumerStatus]
    # Why extraction waits (None: it does not): the window is full and nobody, or too slow a consumer, frees it.
    waiting: str | None = None
    # consumer -> what it still has to do of the epochs it trains (`dflash-queue run` stays up for it).
    to_go: dict[str, str] = field(default_factory=dict)

    @property
    def pending(self) -> bool:
        """An epoch started and not all extracted, or a consumer with epochs to go: the run is not finished."""
        return self.epoch_done + self.epoch_failed < self.epoch_shards or bool(self.to_go)


def collect_live(client: redis.Redis, run_name: str, window: int, *, now: float | None = None) -> LiveStatus | None:
    """None for a run no consumer follows and with no window (extract.max_unconsumed_shards) or later epoch."""
    now = time.time() if now is None else now
    consumption = ShardWindow(client, run_name)
    ledger = Ledger(client, run_name)
    consumers = consumption.consumers()
    epoch = consumption.last_epoch()
    if not consumers and not window and epoch == 0:
        return None
    shards = consumption.epoch_shards(epoch) or {}
    states = epoch_states(consumption, ledger, epoch, list(shards))
    done = {s for s, state in states.items() if state == DONE}
    status = LiveStatus(
        epoch=epoch,
        epoch_shards=len(shards),
        epoch_done=len(done),
        epoch_failed=sum(state == FAILED for state in states.values()),
        window_size=window,
        window_fill=consumption.window_fill(),
        consumers=[],
        to_go=consumption.to_go(ledger),
    )
    for name, fields in sorted(consumers.items()):
        seen = consumption.ranks_seen(name)
        consumer_epoch = max((int(r["epoch"]) for r in seen.values()), default=0)
        consumer_states = states if consumer_epoch == epoch else None
        if consumer_states is None:
            consumer_shards = consumption.epoch_shards(consumer_epoch) or {}
            consumer_states = epoch_states(consumption, ledger, consumer_epoch, list(consumer_shards))
        consumer_done = {s for s, state in consumer_states.items() if state == DONE}
        acknowledged = consumption.acknowledged(name, consumer_epoch)
        status.consumers.append(
            ConsumerStatus(
                name=name,
                world_size=int(fields.get("world_size", 1)),
                epoch=consumer_epoch,
                acknowledged=len(acknowledged),
                lag=len(consumer_done - acknowledged),
                ranks_seen_s={rank: round(now - float(r["at"]), 1) for rank, r in sorted(seen.items())},
            )
        )
    waiting = consumption.waiting()
    if waiting is not None and window and status.window_fill >= window:
        status.waiting = _why_waiting(status, waiting)
    return status


def _why_waiting(status: LiveStatus, waiting: dict) -> str:
    head = (
        f"extraction waits: the window is full ({status.window_fill} of {status.window_size} shards not consumed "
        f"by every consumer; shard {waiting['shard']} of epoch {waiting['epoch']} waits)"
    )
    if not status.consumers:
        return head + "; no consumer is registered: start the trainer (dflash_queue.live.LiveShards)"
    behind = [f"{c.name} ({c.lag} shards behind)" for c in status.consumers if c.lag]
    silent = [f"{c.name} ranks {c.silent_ranks} silent" for c in status.consumers if c.silent_ranks]
    return head + "; " + "; ".join(behind + silent or ["the consumers are reading"])
