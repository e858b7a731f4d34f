"""A worker's heartbeat thread: it registers the worker process (an incarnation), keeps its liveness key, records
the messages it takes, and puts back those of dead incarnations, its own predecessors under the same node name
first (see queue/liveness.py). A worker whose node name a live worker holds is refused at start (NodeNameInUse)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from celery import Celery, signals

from dflash_queue.errors import DflashQueueError
from dflash_queue.queue.liveness import HeldMessage, Incarnation, Liveness
from dflash_queue.runstate.ledger import resilient_client

log = logging.getLogger(__name__)


class NodeNameInUse(DflashQueueError):
    """A live worker (heartbeat fresh, process running or out of sight) runs under the node name this one starts
    under: the two would put back each other's messages as a dead predecessor's."""


def put_back(app: Celery, liveness: Liveness, incarnations: list[Incarnation]) -> list[HeldMessage]:
    """Put the still-unacknowledged messages of `incarnations` (dead ones) back on their queues and forget those
    incarnations; returns the messages put back."""
    restored: list[HeldMessage] = []
    if not incarnations:
        return restored
    held = liveness.held_by(incarnations)
    if held:
        with app.connection_for_write() as connection:
            channel = connection.default_channel
            client = channel.client
            for message in held:
                if client.hexists(channel.unacked_key, message.tag):
                    channel.qos.restore_by_tag(message.tag, client=client)
                    restored.append(message)
                liveness.done(message.incarnation, message.task_id)
    for incarnation in incarnations:
        liveness.leave(incarnation.id)
    return restored


def restore_held_by_dead(app: Celery, liveness: Liveness) -> list[HeldMessage]:
    """Put the still-unacknowledged messages of dead incarnations back on their queues; returns those put back."""
    return put_back(app, liveness, liveness.dead())


class Heartbeat:
    """A worker's heartbeat thread, its record of the messages it holds, and its share of putting back the
    messages of dead workers."""

    def __init__(self, app: Celery, broker_url: str, run_name: str, node: str, ttl_s: int) -> None:
        self.app = app
        self.node = node
        self.incarnation = Incarnation.of_this_process(node)
        self.liveness = Liveness(resilient_client(broker_url), run_name, ttl_s)
        self.interval_s = ttl_s / 3
        # Called after every beat (an extract worker looks whether a reference audit halted it).
        self.on_beat: list[Callable[[], object]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dfq-heartbeat", daemon=True)
        self._succeeded = False

    def refuse_live_namesakes(self) -> None:
        """Raise NodeNameInUse, naming them, when live workers run under this node name; called before this worker
        succeeds its predecessors. A broker that cannot be asked is logged and lets the worker start."""
        try:
            live = self.liveness.live_namesakes(self.incarnation)
            seen = {i.id: self.liveness.last_seen(i.id) for i in live}
        except Exception:
            log.exception("could not look for live workers named %s; starting", self.node)
            return
        if not live:
            return
        now = time.time()
        described = []
        for namesake in live:
            beat = seen[namesake.id]
            ago = f"last heartbeat {max(0.0, now - beat):.0f} s ago" if beat is not None else "heartbeat fresh"
            where = namesake.process.out_of_sight() or "its process runs on this machine"
            described.append(f"{namesake.describe()}: {ago}; {where}")
        raise NodeNameInUse(
            f"node name {self.node} is in use by a live worker of run {self.liveness.keys.run_name}:\n  "
            + "\n  ".join(described)
            + f"\ntwo workers under one name would put back each other's tasks: give this one a name of its own "
            f"(--hostname, or --gpus, which the default name carries). If that worker is gone (its container "
            f"restarted), the name is free once its heartbeat expires, at most {self.liveness.ttl_s} s "
            f"(broker.worker_liveness_s) after it stopped"
        )

    def succeed_predecessors(self) -> list[HeldMessage]:
        """Put back what earlier workers under this node name held (a crashed worker restarted under its name):
        called before this worker takes anything. Failures are logged; the beats try again."""
        try:
            predecessors = self.liveness.predecessors(self.incarnation)
            restored = put_back(self.app, self.liveness, predecessors)
        except Exception:
            log.exception("could not put back what earlier workers named %s held; the heartbeat tries again", self.node)
            return []
        for predecessor in predecessors:
            mine = [m for m in restored if m.incarnation == predecessor.id]
            log.warning(
                "succeeding %s: put back %d message(s) it held (%s)", predecessor.describe(), len(mine),
                ", ".join(f"{m.queue} task {m.task_id}, shard {m.shard_id}" for m in mine) or "none unacknowledged",
            )
        # Said once per start, found or not: a restarted worker's log tells whether it took over anything.
        log.info(
            "put back %d task(s) of its predecessor(s) under node name %s (%d earlier worker(s) gone)",
            len(restored), self.node, len(predecessors),
        )
        self._succeeded = True
        return restored

    def start(self) -> None:
        if not self._succeeded:  # the worker's start-up did it, unless the broker failed it then
            self.succeed_predecessors()
        try:
            self.liveness.register(self.incarnation)
        except Exception:
            log.exception("could not register this worker's heartbeat; trying again in %.0f s", self.interval_s)
        signals.task_received.connect(self._received, weak=False)
        signals.task_postrun.connect(self._finished, weak=False)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        signals.task_received.disconnect(self._received)
        signals.task_postrun.disconnect(self._finished)
        try:
            self.liveness.leave(self.incarnation.id)
        except Exception:
            log.exception("could not remove this worker's heartbeat")

    def _received(self, request=None, **_kwargs) -> None:
        try:
            args = request.args or ()
            self.liveness.took(
                self.incarnation.id,
                request.id,
                str(request.message.delivery_tag),
                (request.delivery_info or {}).get("routing_key", ""),
                str(args[0]) if args else "",
            )
        except Exception:  # bookkeeping never stops a task
            log.exception("could not record a received message")

    def _finished(self, task_id=None, **_kwargs) -> None:
        try:
            self.liveness.done(self.incarnation.id, task_id or "")
        except Exception:
            log.exception("could not forget a finished message")

    def _beat(self) -> None:
        # Registered again on every beat: a broker restored from an old copy, or one that was down when the worker
        # started, knows this worker as soon as it answers.
        self.liveness.register(self.incarnation)
        for message in restore_held_by_dead(self.app, self.liveness):
            log.warning(
                "put back on %s: task %s (shard %s) held by %s, whose heartbeat stopped or whose process is gone",
                message.queue, message.task_id, message.shard_id, message.node,
            )
        for callback in self.on_beat:
            callback()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._beat()
            except Exception:
                log.exception("heartbeat failed; trying again in %.0f s", self.interval_s)
