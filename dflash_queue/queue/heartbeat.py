"""A worker's heartbeat thread: it keeps the worker's liveness key, records the messages the worker takes, and puts
back those of workers whose heartbeat stopped (see dflash_queue/liveness.py)."""

from __future__ import annotations

import logging
import threading

from celery import Celery, signals

from dflash_queue.ledger import resilient_client
from dflash_queue.liveness import HeldMessage, Liveness

log = logging.getLogger(__name__)


def restore_held_by_dead(app: Celery, liveness: Liveness) -> list[HeldMessage]:
    """Put the still-unacknowledged messages of dead nodes back on their queues; returns those put back."""
    restored: list[HeldMessage] = []
    held = liveness.held_by_dead()
    if not held:
        return restored
    with app.connection_for_write() as connection:
        channel = connection.default_channel
        client = channel.client
        for message in held:
            if client.hexists(channel.unacked_key, message.tag):
                channel.qos.restore_by_tag(message.tag, client=client)
                restored.append(message)
            liveness.done(message.node, message.task_id)
    return restored


class Heartbeat:
    """A worker's heartbeat thread, its record of the messages it holds, and its share of putting back the
    messages of dead workers."""

    def __init__(self, app: Celery, broker_url: str, run_name: str, node: str, ttl_s: int) -> None:
        self.app = app
        self.node = node
        self.liveness = Liveness(resilient_client(broker_url), run_name, ttl_s)
        self.interval_s = ttl_s / 3
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dfq-heartbeat", daemon=True)

    def start(self) -> None:
        self.liveness.beat(self.node)
        signals.task_received.connect(self._received, weak=False)
        signals.task_postrun.connect(self._finished, weak=False)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        signals.task_received.disconnect(self._received)
        signals.task_postrun.disconnect(self._finished)
        try:
            self.liveness.leave(self.node)
        except Exception:
            log.exception("could not remove this worker's heartbeat")

    def _received(self, request=None, **_kwargs) -> None:
        try:
            args = request.args or ()
            self.liveness.took(
                self.node,
                request.id,
                str(request.message.delivery_tag),
                (request.delivery_info or {}).get("routing_key", ""),
                str(args[0]) if args else "",
            )
        except Exception:  # bookkeeping never stops a task
            log.exception("could not record a received message")

    def _finished(self, task_id=None, **_kwargs) -> None:
        try:
            self.liveness.done(self.node, task_id or "")
        except Exception:
            log.exception("could not forget a finished message")

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.liveness.beat(self.node)
                for message in restore_held_by_dead(self.app, self.liveness):
                    log.warning(
                        "put back on %s: task %s (shard %s) held by %s, whose heartbeat stopped",
                        message.queue, message.task_id, message.shard_id, message.node,
                    )
            except Exception:
                log.exception("heartbeat failed; trying again in %.0f s", self.interval_s)
