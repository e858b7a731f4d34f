"""A Redis Sentinel group on loopback: a primary, a replica and three sentinels, all the same redis-server binary
(the sentinels in `--sentinel` mode), quick to notice a dead primary and promote the replica."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import redis

from dflash_queue.broker.redis_server import find_redis_server, free_port

MASTER_NAME = "dfq-broker"
# A primary that answers no sentinel for this long is down (sentinels need a quorum of 2 of 3 to agree): long
# enough that a test machine busy with engines does not fail a live primary over.
DOWN_AFTER_MS = 3000
FAILOVER_TIMEOUT_MS = 5000


class SentinelGroup:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.binary = find_redis_server()
        self.data_ports = [free_port(), free_port()]  # the first starts as primary, the second as its replica
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.processes: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        """What broker.url holds (broker.sentinel_master is MASTER_NAME)."""
        return ";".join(f"sentinel://127.0.0.1:{port}" for port in self.sentinel_ports) + "/0"

    def _spawn(self, port: int, args: list[str]) -> None:
        workdir = self.directory / str(port)
        workdir.mkdir(parents=True, exist_ok=True)
        self.processes[port] = subprocess.Popen(
            [self.binary, *args], cwd=workdir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def _data_args(self, port: int) -> list[str]:
        workdir = self.directory / str(port)
        return [
            "--bind", "127.0.0.1", "--port", str(port), "--dir", str(workdir), "--save", "",
            "--appendonly", "yes", "--appendfsync", "everysec", "--maxmemory-policy", "noeviction",
            "--logfile", str(workdir / "redis.log"),
        ]  # fmt: skip

    def start(self, timeout: float = 30.0) -> SentinelGroup:
        primary, replica = self.data_ports
        self._spawn(primary, self._data_args(primary))
        self._spawn(replica, [*self._data_args(replica), "--replicaof", "127.0.0.1", str(primary)])
        for port in self.sentinel_ports:
            workdir = self.directory / str(port)
            workdir.mkdir(parents=True, exist_ok=True)
            conf = workdir / "sentinel.conf"  # a sentinel rewrites its config file: each has its own
            conf.write_text(
                f"bind 127.0.0.1\nport {port}\ndir {workdir}\nlogfile {workdir / 'sentinel.log'}\n"
                f"sentinel monitor {MASTER_NAME} 127.0.0.1 {primary} 2\n"
                f"sentinel down-after-milliseconds {MASTER_NAME} {DOWN_AFTER_MS}\n"
                f"sentinel failover-timeout {MASTER_NAME} {FAILOVER_TIMEOUT_MS}\n"
                f"sentinel parallel-syncs {MASTER_NAME} 1\n"
            )
            self._spawn(port, [str(conf), "--sentinel"])
        deadline = time.monotonic() + timeout
        while not self._ready():
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"the sentinel group in {self.directory} was not ready within {timeout}s")
            time.sleep(0.1)
        return self

    def _ready(self) -> bool:
        """The replica in sync, and every sentinel seeing the other two and the replica."""
        try:
            info = redis.Redis(port=self.data_ports[1], socket_timeout=1).info("replication")
            if info.get("master_link_status") != "up":
                return False
            for port in self.sentinel_ports:
                state = redis.Redis(port=port, socket_timeout=1).sentinel_master(MASTER_NAME)
                if int(state["num-other-sentinels"]) < 2 or int(state["num-slaves"]) < 1:
                    return False
        except redis.RedisError:
            return False
        return True

    def primary_port(self) -> int:
        """The port of the primary the sentinels name now."""
        host, port = redis.Redis(port=self.sentinel_ports[0], socket_timeout=1).sentinel_get_master_addr_by_name(
            MASTER_NAME
        )
        return int(port)

    def kill(self, port: int) -> None:
        """SIGKILL the redis-server on `port`: its machine lost."""
        process = self.processes[port]
        process.kill()
        process.wait()

    def wait_for_failover(self, old_primary: int, timeout: float = 60.0) -> int:
        """The port of the new primary once the sentinels promoted it and it accepts writes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                port = self.primary_port()
                if port != old_primary and redis.Redis(port=port, socket_timeout=1).info("replication")["role"] == "master":
                    return port
            except redis.RedisError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"no replica of {old_primary} was promoted within {timeout}s")

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()
        self.processes.clear()
