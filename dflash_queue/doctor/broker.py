"""The broker: reachable, closed to clients without a password unless on loopback, persistent (AOF), and never
evicting (queued messages are data)."""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import redis

from dflash_queue.doctor.result import Check
from dflash_queue.redaction import redact
from dflash_queue.runstate.redis_connect import is_sentinel_url, parse_sentinel_url, redis_client

LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name) is this machine only; no host (a unix socket) is."""
    if not host or host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        addresses = {str(info[4][0]) for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def password_verdict(host: str, needs_password: bool) -> Check:
    """A broker that answers clients without a password is open to anyone who reaches its address: fine on
    loopback, not on an address other machines reach (they could read, delete or forge the queued work)."""
    if needs_password:
        return Check.passed("broker password", "the broker refuses clients without a password")
    if is_loopback(host):
        return Check.passed("broker password", f"no password needed, but {host or 'a unix socket'} is loopback only")
    return Check.warned(
        "broker password",
        f"the broker at {host} answers without a password: anyone who reaches it can read, delete or forge the "
        "queued work. Set requirepass or a worker ACL user, and the password in DFQ_BROKER_PASSWORD or a file "
        "(see docs/operations.md, Securing the broker)",
    )


def shown(url: str) -> str:
    """`url` as it may be shown: without passwords (a Sentinel URL holds two)."""
    return parse_sentinel_url(url).shown() if is_sentinel_url(url) else redact(url)


def broker_host(url: str, *, timeout_s: float = 5.0) -> str:
    """The host clients reach the broker at: the primary the sentinels name now, for a Sentinel URL."""
    if not is_sentinel_url(url):
        return urlsplit(url).hostname or ""
    target = parse_sentinel_url(url)
    options = {"socket_connect_timeout": timeout_s, "socket_timeout": timeout_s}
    return str(target.sentinel(**options).discover_master(target.master_name)[0])


def needs_password(url: str, *, timeout_s: float = 5.0) -> bool:
    """Whether the broker at `url` refuses a client that gives no user and no password."""
    options: dict[str, Any] = {"socket_connect_timeout": timeout_s, "socket_timeout": timeout_s}
    if is_sentinel_url(url):
        target = parse_sentinel_url(url)
        host, port = target.sentinel(**options).discover_master(target.master_name)
        client = redis.Redis(host=host, port=port, **options)
    else:
        parts = urlsplit(url)
        bare = parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()
        client = redis.Redis.from_url(bare, **options)
    try:
        client.ping()
    except redis.AuthenticationError:
        return True
    finally:
        client.close()
    return False


@dataclass(frozen=True)
class BrokerProblem:
    """Why a client cannot use the broker, in one line naming the setting to fix: it refuses the login
    (`refused`), or it does not answer."""

    message: str
    refused: bool


# Where the password comes from (queue/config.py): named in every refusal.
PASSWORD_SETTINGS = "DFQ_BROKER_PASSWORD, DFQ_BROKER_PASSWORD_FILE or broker.password_file"


def broker_problem(url: str, *, password_from: str = "", timeout_s: float = 3.0) -> BrokerProblem | None:
    """Whether the broker at `url` (credentials in it) lets a client in: None when it does, else why, in one line
    that names the setting to fix and never holds the password. `password_from`: where the URL's password came
    from (BrokerConfig.password_origin)."""
    parts = urlsplit(url.split(";")[0])  # the credentials; a Sentinel URL has them on its first address
    where = shown(url)
    who = f"user {parts.username!r}" if parts.username else "the default user"
    client = redis_client(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
    try:
        client.ping()
    except redis.AuthenticationError as exc:
        if parts.password is None:
            return BrokerProblem(
                f"broker {where} refuses {who}: it needs a password and none is set; set {PASSWORD_SETTINGS}"
                + ("" if parts.username else " (and broker.username for an ACL user)"),
                refused=True,
            )
        said = str(exc).strip().rstrip(".")
        return BrokerProblem(
            f"broker {where} refuses {who}: {said} (the password from {password_from or PASSWORD_SETTINGS}; check "
            "it and broker.username)",
            refused=True,
        )
    except redis.exceptions.NoPermissionError as exc:
        return BrokerProblem(f"broker {where}: {who} may not run the commands workers need: {_one_line(exc)} "
                             "(broker.username names a user without them)", refused=True)
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        return BrokerProblem(
            f"broker {where} does not answer ({_one_line(exc)}): check broker.url (or DFQ_BROKER_URL) and that its "
            "redis-server runs and is reachable from here",
            refused=False,
        )
    except redis.RedisError as exc:
        return BrokerProblem(f"broker {where}: {type(exc).__name__}: {_one_line(exc)} (check broker.url)",
                             refused=False)
    finally:
        client.close()
    return None


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()).rstrip(".")


def login_error(url: str, *, password_from: str = "", timeout_s: float = 5.0) -> str | None:
    """Why the broker refuses these credentials (wrong password, no password given, a user without the
    rights workers need), None when it accepts them or does not answer (the connection's retries report
    that). The message never holds the password."""
    problem = broker_problem(url, password_from=password_from, timeout_s=timeout_s)
    return problem.message if problem is not None and problem.refused else None


def check_broker(url: str, *, timeout_s: float = 5.0) -> list[Check]:
    if not url:
        return [
            Check.warned(
                "broker",
                "broker.url is empty: `dflash-queue run` starts a private redis-server (AOF on, noeviction); "
                "workers on other machines need a URL (broker.url or DFQ_BROKER_URL)",
            )
        ]
    where = shown(url)
    client = redis_client(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
    try:
        client.ping()
        server = client.info("server")
        persistence = client.info("persistence")
        memory = client.info("memory")
        replication = client.info("replication")
    except redis.RedisError as exc:
        return [Check.failed("broker reachable", f"{where}: {type(exc).__name__}: {exc}")]
    finally:
        client.close()
    checks = [Check.passed("broker reachable", f"redis {server.get('redis_version', '?')} at {where}")]
    if is_sentinel_url(url):
        checks.append(sentinel_check(url, replication, timeout_s=timeout_s))
    try:
        checks.append(password_verdict(broker_host(url, timeout_s=timeout_s),
                                       needs_password(url, timeout_s=timeout_s)))
    except redis.RedisError as exc:
        checks.append(Check.warned("broker password", f"{where}: cannot tell: {type(exc).__name__}: {exc}"))

    if int(persistence.get("aof_enabled", 0)) == 1:
        checks.append(Check.passed("broker AOF", "appendonly yes: queued messages survive a Redis restart"))
    else:
        checks.append(
            Check.failed(
                "broker AOF",
                "appendonly no: a Redis restart loses every queued message silently; set `appendonly yes`",
            )
        )

    policy = memory.get("maxmemory_policy", "")
    if policy == "noeviction":
        checks.append(Check.passed("broker eviction", "maxmemory-policy noeviction"))
    elif not policy:
        checks.append(
            Check.warned("broker eviction", "the server does not report maxmemory_policy; check it is noeviction")
        )
    else:
        checks.append(
            Check.failed(
                "broker eviction",
                f"maxmemory-policy {policy}: under memory pressure Redis would delete queued messages; "
                "set `maxmemory-policy noeviction`",
            )
        )
    return checks


def sentinel_check(url: str, replication: dict, *, timeout_s: float = 5.0) -> Check:
    """How many sentinels answer and know the primary, and how many replicas it has: a failover needs a quorum
    of sentinels, and a replica to promote."""
    target = parse_sentinel_url(url)
    answering: list[str] = []
    silent: list[str] = []
    for host, port in target.sentinels:
        client = redis.Redis(host=host, port=port, socket_connect_timeout=timeout_s, socket_timeout=timeout_s,
                             **target.sentinel_kwargs())
        try:
            client.sentinel_master(target.master_name)
            answering.append(f"{host}:{port}")
        except redis.RedisError as exc:
            silent.append(f"{host}:{port} ({type(exc).__name__}: {_one_line(exc)})")
        finally:
            client.close()
    replicas = int(replication.get("connected_slaves", 0))
    detail = (f"{len(answering)} of {len(target.sentinels)} sentinels know master {target.master_name!r}; "
              f"the primary has {replicas} connected replica(s)")
    if silent:
        return Check.warned("broker sentinels", f"{detail}; not answering: {', '.join(silent)}")
    if replicas == 0:
        return Check.warned("broker sentinels", f"{detail}: no replica to promote if the primary is lost")
    return Check.passed("broker sentinels", detail)


DURABILITY_CHECKS = ("broker AOF", "broker eviction")


def durability_warnings(url: str, *, timeout_s: float = 5.0) -> list[str]:
    """One line per setting that lets the broker lose queued messages (no AOF, an evicting memory policy).

    Empty for a durable broker, and for one that does not answer: a worker's own connection reports that.
    """
    if not url:
        return []
    return [
        f"{check.name}: {check.detail}"
        for check in check_broker(url, timeout_s=timeout_s)
        if check.name in DURABILITY_CHECKS and check.verdict != "pass"
    ]
