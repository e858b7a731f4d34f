"""The broker: reachable, persistent (AOF), and never evicting (queued messages are data)."""

from __future__ import annotations

import redis

from dflash_queue.doctor.result import Check
from dflash_queue.redaction import redact


def check_broker(url: str, *, timeout_s: float = 5.0) -> list[Check]:
    if not url:
        return [
            Check.warned(
                "broker",
                "broker.url is empty: `dflash-queue run` starts a private redis-server (AOF on, noeviction); "
                "workers on other machines need a URL (broker.url or DFQ_BROKER_URL)",
            )
        ]
    where = redact(url)
    client = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
    try:
        client.ping()
        server = client.info("server")
        persistence = client.info("persistence")
        memory = client.info("memory")
    except redis.RedisError as exc:
        return [Check.failed("broker reachable", f"{where}: {type(exc).__name__}: {exc}")]
    finally:
        client.close()
    checks = [Check.passed("broker reachable", f"redis {server.get('redis_version', '?')} at {where}")]

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
