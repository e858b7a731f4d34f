"""Generate workers waiting because every inference server they were given is down, as `status` shows them.

A worker on the inference-server engine (`generate.engine = "server"`) whose every server is down does not fail
its tasks: it waits for a server to come back. While it waits, a thread of the worker keeps a record under
`dfq:{run}:servers_down:{worker}` (JSON: since when, and why per server), refreshed every few seconds and
expiring soon after the worker stops refreshing it (the servers came back, or the worker is gone). `run` prints a
line when such a wait begins and one when it ends (`OutageNotices`).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from dflash_queue.runstate.keys import RunKeys

log = logging.getLogger(__name__)

REFRESH_S = 5.0


class HasOutage(Protocol):
    since: float
    servers: dict[str, str]


@dataclass(frozen=True)
class ServersDown:
    worker: str
    since: float
    servers: dict[str, str]  # URL -> why it is down

    def describe(self, now: float) -> str:
        return (
            f"generate worker {self.worker} waits: every inference server has been down for "
            f"{self.down_for_s(now)} s ({self.reasons()})"
        )

    def began(self) -> str:
        return (
            f"generate worker {self.worker} waits: every inference server is down since {clock(self.since)} "
            f"({self.reasons()}); its tasks wait, none fails"
        )

    def ended(self, now: float) -> str:
        return (
            f"generate worker {self.worker}: an inference server is back after {self.down_for_s(now)} s down; "
            "generation goes on"
        )

    def down_for_s(self, now: float) -> int:
        return max(0, int(now - self.since))

    def reasons(self) -> str:
        return "; ".join(f"{url}: {why}" for url, why in self.servers.items())


def clock(moment: float) -> str:
    """A time of day in local time, as a terminal next to it shows it."""
    return time.strftime("%H:%M:%S", time.localtime(moment))


class ServerWaits:
    """The records, on a Redis client with decode_responses=True."""

    def __init__(self, client: Any, run_name: str) -> None:
        self.client = client
        self.keys = RunKeys(run_name)
        self.prefix = self.keys.servers_down_prefix

    def note(self, worker: str, since: float, servers: dict[str, str], ttl_s: float) -> None:
        record = json.dumps({"since": since, "servers": servers})
        self.client.set(self.keys.servers_down(worker), record, ex=max(1, int(ttl_s)))

    def clear(self, worker: str) -> None:
        self.client.delete(self.keys.servers_down(worker))

    def all(self) -> list[ServersDown]:
        found = []
        for key in sorted(self.client.scan_iter(match=self.prefix + "*", count=1000)):
            raw = self.client.get(key)
            if raw is None:  # expired between the scan and the read
                continue
            record = json.loads(raw)
            found.append(ServersDown(key[len(self.prefix) :], float(record["since"]), dict(record["servers"])))
        return found


class OutageNotices:
    """What `run` prints of the waits: a line when a worker's wait begins and one when it ends, each once."""

    def __init__(self, waits: ServerWaits) -> None:
        self.waits = waits
        self.waiting: dict[str, ServersDown] = {}

    def lines(self, now: float) -> list[str]:
        current = {wait.worker: wait for wait in self.waits.all()}
        began = [wait.began() for worker, wait in current.items() if worker not in self.waiting]
        ended = [wait.ended(now) for worker, wait in self.waiting.items() if worker not in current]
        self.waiting = current
        return ended + began

    def over(self, now: float) -> list[str]:
        """The work was done: any wait still on record has ended (its record outlives it by a refresh)."""
        ended = [wait.ended(now) for wait in self.waiting.values()]
        self.waiting = {}
        return ended


def worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class OutageReporter:
    """A thread that writes `outage()` (None: no outage) to the records every `interval_s` while there is one,
    and clears the record when it ends. Broker errors are logged, never raised: the report is a courtesy."""

    def __init__(
        self,
        outage: Callable[[], HasOutage | None],
        waits: ServerWaits,
        worker: str | None = None,
        interval_s: float = REFRESH_S,
    ) -> None:
        self.outage = outage
        self.waits = waits
        self.worker = worker or worker_name()
        self.interval_s = interval_s
        self._reported = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dfq-server-outage", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.report()

    def report(self) -> None:
        try:
            outage = self.outage()
            if outage is not None:
                self.waits.note(self.worker, outage.since, outage.servers, ttl_s=3 * self.interval_s + 1)
                self._reported = True
            elif self._reported:
                self.waits.clear(self.worker)
                self._reported = False
        except Exception:
            log.exception("could not record the inference servers' outage for `status`")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.interval_s + 5)
        if self._reported:
            try:
                self.waits.clear(self.worker)
            except Exception:
                log.exception("could not clear the inference servers' outage record")
