"""A worker's connections to its inference servers: which are up, where each request goes, what a failure means.

Every request goes to the server that is up with the fewest of this worker's requests outstanding, so a slow or
lost server's share moves to the others. All of it runs on one event loop (engines/loop_thread.py) that every
task thread of the worker submits to, which keeps the servers full across task boundaries.

What a failure means:
  * the server cannot serve now (connection refused or reset before an answer, 502/503/504, 408, 429, a refused
    API key, the model gone): the server is marked down and probed with backoff; the request goes to another
    server, or waits for one to come back. A request never pays for a server's outage.
  * the request failed on a server that still answers its health check (a 5xx, a timeout, a reply without token
    ids): it is tried again with backoff, on the least loaded server; after `max_tries` tries the sample is
    given up (SampleDependentError: the lane dead-letters it alone with the server's words). A storm of them
    opens the server's breaker (engines/server/breaker.py): it counts as down, and the storm costs no tries.
  * the connection broke after the request was sent while the server still answers its health check: one try,
    as above, and the server is out of use until it passed its check again (it may have been restarted, with
    other weights, behind the same URL or a balancer).
  * the server refuses the request itself (another 4xx: over its context length, a bad token id): the sample
    is rejected at once with the server's words.
A failure that comes back from a server already out of use (down, being checked, its breaker open) costs no try.
A server is checked (`admit`: the model it serves, its weights) before it gets requests: at start, when it comes
back, after a broken connection, and every `recheck_interval_s` while in use (it stays in use meanwhile, and is
marked down when it fails). While every server is down the worker waits; `outage()` says since when and why, for
`status`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
import orjson

from dflash_queue.engines.config import ServerConfig
from dflash_queue.engines.server.breaker import TRIAL, Breaker, Tries
from dflash_queue.engines.server.protocols import ReplyError, ServerProtocol, server_words
from dflash_queue.errors import WorkerShuttingDown

log = logging.getLogger(__name__)

T = TypeVar("T")

# Statuses that say the server (or the balancer before it) cannot serve now, whatever the request.
SERVER_DOWN_STATUSES = frozenset({401, 403, 404, 408, 429, 502, 503, 504})


class ServerDown(Exception):
    """The server cannot serve now; not the request's fault."""


class RequestFailed(Exception):
    """The request failed on this server in a way that may be its own (counted against `max_tries`)."""


class ConnectionBroke(RequestFailed):
    """The connection broke after the request was sent (the server may have been restarted)."""


class RequestRejected(Exception):
    """The server refused the request itself (a 4xx): retrying cannot help."""

    def __init__(self, status: int, words: str) -> None:
        super().__init__(f"{status}: {words}")
        self.status = status
        self.words = words


@dataclass(frozen=True)
class Outage:
    """Every server is down: since when (wall-clock seconds) and why, per server URL."""

    since: float
    servers: dict[str, str]


@dataclass
class Server:
    url: str
    breaker: Breaker
    up: bool = False
    # Why it is down (empty while up), and since when (wall clock).
    reason: str = "not checked yet"
    down_since: float = 0.0
    outstanding: int = 0
    sent: int = 0
    probing: asyncio.Task | None = None
    # What its last check could not verify (the tokenizer of a server without a tokenize endpoint), and how far (in
    # nats) its weights probe's logprobs lay from the run's record at that check: for doctor.
    unchecked: tuple[str, ...] = ()
    weights_apart: float | None = None


# Checks a server that (again) answers: "" when it may serve, else why not.
Admit = Callable[["ServerPool", Server], Awaitable[str]]


class ServerPool:
    def __init__(self, settings: ServerConfig, protocol: ServerProtocol, admit: Admit, api_key: str | None) -> None:
        self.settings = settings
        self.protocol = protocol
        self.servers = [Server(url, Breaker(settings.breaker_failures)) for url in settings.urls]
        self._admit = admit
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None
        self._slots = asyncio.Semaphore(settings.requests_in_flight)
        self._changed = asyncio.Condition()
        self._closing = False
        self._request_ids = itertools.count()
        self._waiting_logged = False
        self._rechecking: asyncio.Task | None = None
        self._notifying: set[asyncio.Task] = set()

    # -- life cycle ------------------------------------------------------------------------------------------

    async def start(self) -> list[Server]:
        """Open the session and check every server (the first, then the others at once); returns those that are up."""
        settings = self.settings
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=settings.requests_in_flight + 4 * len(self.servers) + 4),
            json_serialize=lambda value: orjson.dumps(value).decode(),
            headers=self._headers,
        )
        # The first server alone, then the others at once: without a recorded weights fingerprint, the first that
        # passes sets the one the others must match, and that is the first listed rather than the fastest.
        await self._check(self.servers[0])
        await asyncio.gather(*(self._check(server) for server in self.servers[1:]))
        for server in self.servers:
            if not server.up:
                self._start_probing(server, settings.backoff_initial_s)
        if settings.recheck_interval_s:
            self._rechecking = asyncio.get_running_loop().create_task(self._recheck_periodically())
        return [server for server in self.servers if server.up]

    def begin_shutdown(self) -> None:
        """Requests waiting for a server, now or later, give up (WorkerShuttingDown: their task goes back to the
        queue); while a server is up, requests go on as before (the running tasks finish)."""
        self._closing = True
        self._notify_soon()

    async def close(self) -> None:
        self._closing = True
        await self._notify()
        probes = [s.probing for s in self.servers if s.probing is not None]
        if self._rechecking is not None:
            probes.append(self._rechecking)
        for task in probes:
            task.cancel()
        await asyncio.gather(*probes, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    # -- state -----------------------------------------------------------------------------------------------

    def outage(self) -> Outage | None:
        """Every server down: since when and why; None while one is up. Safe to call from any thread."""
        servers = list(self.servers)
        if any(server.up for server in servers):
            return None
        return Outage(
            since=min((s.down_since for s in servers if s.down_since), default=time.time()),
            servers={s.url: s.reason for s in servers},
        )

    def mark_down(self, server: Server, reason: str, *, probe_after_s: float | None = None) -> None:
        if server.up:
            log.warning("inference server %s is down (%s): its requests go to the other servers", server.url, reason)
            server.down_since = time.time()
        elif not server.down_since:
            server.down_since = time.time()
        server.up, server.reason = False, reason
        self._start_probing(server, self.settings.backoff_initial_s if probe_after_s is None else probe_after_s)

    def recheck(self, server: Server, why: str) -> None:
        """Take the server out of use and check it again at once (health, then `admit`); back in use if it passes."""
        if not server.up:
            return
        log.info("inference server %s: %s; checked again before it gets more requests", server.url, why)
        server.up, server.reason, server.down_since = False, f"checked again after {why}", time.time()
        self._start_probing(server, 0.0)

    async def _mark_up(self, server: Server) -> None:
        if server.breaker.passed_check():
            log.info("inference server %s passed its check: its breaker is half-open (one trial request)", server.url)
        elif not server.up:
            log.info("inference server %s is up", server.url)
        server.breaker.failures_in_row = 0
        server.up, server.reason, server.down_since = True, "", 0.0
        self._waiting_logged = False
        await self._notify()

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def _notify_soon(self) -> None:
        task = asyncio.get_running_loop().create_task(self._notify())
        self._notifying.add(task)
        task.add_done_callback(self._notifying.discard)

    async def _check(self, server: Server) -> None:
        """Admit the server (its identity) or mark it down with the reason."""
        try:
            problem = await self._admit(self, server)
        except (ServerDown, RequestFailed, RequestRejected) as exc:
            problem = str(exc)
        if problem:
            self.mark_down(server, problem)
        else:
            await self._mark_up(server)

    def _start_probing(self, server: Server, first_delay_s: float) -> None:
        if self._closing or (server.probing is not None and not server.probing.done()):
            return
        server.probing = asyncio.get_running_loop().create_task(self._probe(server, first_delay_s))

    async def _probe(self, server: Server, delay: float) -> None:
        while not server.up and not self._closing:
            await asyncio.sleep(delay)
            delay = min(max(2 * delay, self.settings.backoff_initial_s), self.settings.backoff_max_s)
            if await self.healthy(server):
                await self._check(server)

    async def _recheck_periodically(self) -> None:
        while not self._closing:
            await asyncio.sleep(self.settings.recheck_interval_s)
            await asyncio.gather(*(self._check_in_use(server) for server in self.servers if server.up))

    async def _check_in_use(self, server: Server) -> None:
        """The periodic check: the server stays in use while it runs and is marked down if it fails."""
        try:
            problem = await self._admit(self, server)
        except (ServerDown, RequestFailed, RequestRejected) as exc:
            problem = str(exc)
        if problem and server.up:
            self.mark_down(server, f"failed its periodic check: {problem}")

    async def healthy(self, server: Server) -> bool:
        """Whether the server answers its health endpoint with 200 (the reason is kept when it does not)."""
        try:
            status, body = await self.call(server, "GET", self.protocol.health_path, None,
                                           timeout=self.settings.connect_timeout_s)
        except (ServerDown, RequestFailed) as exc:
            server.reason = str(exc)
            return False
        if status != 200:
            server.reason = f"health check answered {status}: {server_words(body)}"
            return False
        return True

    # -- calls -----------------------------------------------------------------------------------------------

    async def call(
        self, server: Server, method: str, path: str, body: Any, *, timeout: float | None = None
    ) -> tuple[int, Any]:
        """(status, decoded JSON or text) of one HTTP call. ServerDown when the server cannot be reached;
        RequestFailed when the connection broke or timed out after it was made."""
        assert self._session is not None, "the pool is not started"
        settings = self.settings
        timeouts = aiohttp.ClientTimeout(
            total=timeout or settings.request_timeout_s,
            sock_connect=settings.connect_timeout_s,
        )
        try:
            async with self._session.request(method, server.url + path, json=body, timeout=timeouts) as response:
                raw = await response.read()
                return response.status, _decode(raw)
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
            raise ServerDown(f"cannot connect: {_describe(exc)}") from None
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, aiohttp.ClientPayloadError) as exc:
            raise ConnectionBroke(f"{method} {path} failed: {_describe(exc)}") from None
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise RequestFailed(f"{method} {path} failed: {_describe(exc)}") from None

    async def request(self, path: str, make_body: Callable[[str], dict[str, Any]], parse: Callable[[Any], T]) -> T:
        """POST `make_body(request_id)` to `path` on the least loaded server that is up and `parse` the 200 reply
        (a ReplyError counts as a failed try); RequestRejected, or RequestFailed after `max_tries` tries; waits
        while every server is down. `make_body` is called for each try (a fresh request id)."""
        tries = Tries()
        async with self._slots:
            while True:
                server = await self._pick()
                server.outstanding += 1
                server.sent += 1
                try:
                    request_id = f"dfq-{next(self._request_ids)}"
                    status, body = await self.call(server, "POST", path, make_body(request_id))
                    if status == 200:
                        result = parse(body)
                        if server.breaker.succeeded():
                            log.info("inference server %s: its trial request succeeded, its breaker is closed",
                                     server.url)
                            self._notify_soon()
                        return result
                    failure = self.classify(status, body)
                except ServerDown as exc:
                    self.mark_down(server, str(exc))
                    continue
                except RequestFailed as exc:
                    failure = exc
                except ReplyError as exc:
                    failure = RequestFailed(str(exc))
                finally:
                    server.outstanding -= 1
                    if server.breaker.state == TRIAL:
                        self._notify_soon()  # a half-open server may take the next request
                if not server.up:
                    continue  # the server was already out of use when this came back: not the request's doing
                if isinstance(failure, ConnectionBroke):
                    self.recheck(server, f"a broken connection ({failure})")
                elif opened := server.breaker.failed():
                    self._open_breaker(server, failure, opened)
                    if opened == "storm":
                        continue
                if server.up and not await self.healthy(server):
                    self.mark_down(server, f"{failure}; then {server.reason}")
                    continue
                tries.spend(server.breaker)
                if tries.counted() >= self.settings.max_tries:
                    raise RequestFailed(f"{tries.counted()} tries failed; the last, on {server.url}: {failure}")
                await asyncio.sleep(self.backoff_s(tries.counted()))

    def _open_breaker(self, server: Server, failure: RequestFailed, how: str) -> None:
        breaker = self.settings.breaker_failures
        why = (f"its trial request failed ({failure})" if how == "trial"
               else f"{breaker} requests in a row failed while its health check passed (the last: {failure})")
        wait = server.breaker.open_for_s(self.settings.backoff_initial_s, self.settings.backoff_max_s)
        self.mark_down(server, f"breaker open: {why}; checked again in {wait:g} s", probe_after_s=wait)

    def classify(self, status: int, body: Any) -> RequestFailed:
        """A non-200 answer: raises ServerDown or RequestRejected, or returns the RequestFailed to count."""
        words = server_words(body)
        if status in SERVER_DOWN_STATUSES:
            raise ServerDown(f"answered {status}: {words}")
        if 400 <= status < 500:
            raise RequestRejected(status, words)
        return RequestFailed(f"answered {status}: {words}")

    def backoff_s(self, tries: int) -> float:
        return min(self.settings.backoff_initial_s * 2 ** (tries - 1), self.settings.backoff_max_s)

    async def _pick(self) -> Server:
        while True:
            up = [server for server in self.servers if server.up]
            ready = [server for server in up if server.breaker.admits(server.outstanding)]
            if ready:
                return min(ready, key=lambda s: (s.outstanding, s.sent))
            if self._closing and not up:
                raise WorkerShuttingDown("the worker is stopping while every inference server is down")
            if not up and not self._waiting_logged:
                self._waiting_logged = True
                log.warning(
                    "every inference server is down; requests wait for one to come back: %s",
                    "; ".join(f"{s.url}: {s.reason}" for s in self.servers),
                )
            async with self._changed:
                await self._changed.wait()


def _decode(raw: bytes) -> Any:
    if not raw:
        return None
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw.decode("utf-8", errors="replace")[:2000]


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
