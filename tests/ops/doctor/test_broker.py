"""Broker checks against real redis-servers: AOF on and off, another eviction policy, nothing listening."""

from __future__ import annotations

import redis

from dflash_queue.ops.doctor.broker import check_broker
from dflash_queue.redis_server import RedisServer, free_port


def verdicts(checks) -> dict[str, str]:
    return {c.name: c.verdict for c in checks}


def test_a_durable_broker_passes(redis_server):
    checks = check_broker(redis_server.url)
    assert verdicts(checks) == {"broker reachable": "pass", "broker AOF": "pass", "broker eviction": "pass"}
    assert "redis " in checks[0].detail


def test_a_broker_without_aof_or_with_eviction_fails(tmp_path):
    with RedisServer(tmp_path / "no-aof", appendonly=False) as server:
        checks = verdicts(check_broker(server.url))
        assert checks == {"broker reachable": "pass", "broker AOF": "fail", "broker eviction": "pass"}
    with RedisServer(tmp_path / "lru", appendonly=True) as server:
        redis.Redis.from_url(server.url).config_set("maxmemory-policy", "allkeys-lru")
        checks = check_broker(server.url)
        assert verdicts(checks)["broker eviction"] == "fail"
        assert "allkeys-lru" in [c for c in checks if c.name == "broker eviction"][0].detail


def test_an_unreachable_or_missing_broker():
    checks = check_broker(f"redis://:pw@127.0.0.1:{free_port()}/0", timeout_s=1)
    assert [(c.name, c.verdict) for c in checks] == [("broker reachable", "fail")]
    assert ":***@" in checks[0].detail and ":pw@" not in checks[0].detail
    assert [c.verdict for c in check_broker("")] == ["warn"]
