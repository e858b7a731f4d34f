"""Where each shard's message is in the broker: waiting in a lane's queue, or taken by a worker and not yet
acknowledged (kombu's `unacked` hash). Read from Redis as kombu stores it, for `verify` to say what will bring a
missing sample back."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable
from typing import Any

from kombu.transport.redis import Channel

# kombu's priority sub-queues of a queue ("queue", "queue\x06\x163", ...).
PRIORITY_STEPS = Channel.priority_steps


def queue_lists(queue: str) -> list[str]:
    """The Redis lists kombu keeps `queue`'s waiting messages in, one per priority step."""
    return [f"{queue}{Channel.sep}{priority}" if priority else queue for priority in PRIORITY_STEPS]


def task_args(raw: str | bytes) -> list[Any] | None:
    """The positional arguments of a Celery task message as kombu keeps it in Redis (waiting in a list, or an
    unacked entry); None if unreadable."""
    try:
        payload = json.loads(raw)
        if isinstance(payload, list):  # an unacked entry: [message, exchange, routing key]
            payload = payload[0]
        body = payload["body"]
        if payload.get("properties", {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        args = json.loads(body)[0]
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    return args if isinstance(args, list) else None


def shard_of_message(raw: str | bytes) -> str | None:
    """The shard id (first argument) of a lane task message as kombu keeps it in Redis; None if unreadable."""
    args = task_args(raw)
    return str(args[0]) if args else None


def message_places(client: Any, queues: Iterable[str]) -> dict[str, str]:
    """shard id -> "waiting in the {queue} queue" or "taken by a worker ({queue} lane)" for every message found."""
    places: dict[str, str] = {}
    for raw in client.hvals(Channel.unacked_key):
        try:
            routing_key = json.loads(raw)[2]
        except (ValueError, IndexError, TypeError):
            routing_key = "?"
        shard_id = shard_of_message(raw)
        if shard_id:
            places[shard_id] = f"taken by a worker ({routing_key} lane)"
    for queue in queues:
        for name in queue_lists(queue):
            for raw in client.lrange(name, 0, -1):
                shard_id = shard_of_message(raw)
                if shard_id:
                    places.setdefault(shard_id, f"waiting in the {queue} queue")
    return places


def messages_in(client: Any, queue: str) -> int:
    """Messages of `queue` not yet done: waiting in it, or taken by a worker and not yet acknowledged."""
    waiting = sum(client.llen(name) for name in queue_lists(queue))
    taken = 0
    for raw in client.hvals(Channel.unacked_key):
        try:
            taken += json.loads(raw)[2] == queue
        except (ValueError, IndexError, TypeError):
            continue
    return waiting + taken
