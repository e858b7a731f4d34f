"""Broker-side repairs that need kombu's view of the Redis transport."""

from __future__ import annotations

from celery import Celery


def restore_unacked(app: Celery) -> int:
    """Move every unacknowledged message back to its queue; returns how many.

    Safe only when no worker is consuming (a running task's message would be delivered twice): Redis keeps
    delivered-but-unacked messages in a hash until the visibility timeout, and this skips the wait.
    """
    with app.connection_for_write() as connection:
        channel = connection.default_channel
        client = channel.client
        tags = client.hkeys(channel.unacked_key)
        for tag in tags:
            channel.qos.restore_by_tag(tag, client=client)
        return len(tags)
