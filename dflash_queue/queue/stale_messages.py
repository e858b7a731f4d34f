"""Lane messages of a run's former settings (their fingerprint), as kombu keeps them in Redis: counted where a
worker holds one, dropped where they wait. A run started over in place of one that stored nothing leaves none
behind, which a worker of the new settings would refuse for good and fail its shard with."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kombu.transport.redis import Channel

from dflash_queue.queue.messages import queue_lists, task_args


def fingerprint_of(raw: str | bytes) -> str | None:
    """The fingerprint (third argument) of a lane task message as kombu keeps it; None if unreadable."""
    args = task_args(raw)
    return str(args[2]) if args is not None and len(args) > 2 else None


def taken_with(client: Any, fingerprint: str) -> int:
    """Messages of `fingerprint` a worker has taken and not yet acknowledged."""
    return sum(fingerprint_of(raw) == fingerprint for raw in client.hvals(Channel.unacked_key))


def drop_waiting(client: Any, queues: Iterable[str], fingerprint: str) -> int:
    """Remove the messages of `fingerprint` waiting in `queues`; returns how many were removed."""
    dropped = 0
    for queue in queues:
        for name in queue_lists(queue):
            for raw in client.lrange(name, 0, -1):
                if fingerprint_of(raw) == fingerprint:
                    dropped += client.lrem(name, 1, raw)
    return dropped
