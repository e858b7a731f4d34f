"""The broker of a job that `dflash-queue run` ran with an empty `broker.url`: its private redis-server keeps its
data (AOF) in the run's state directory (`<run.state_dir>/redis`), so that the commands that read the broker
(`status`, `dead`, `verify`) answer for that job too: through the run's server while the run is up (it writes its
URL beside the data), else through a redis-server started on that data for the command's duration. A trainer
following the run (dflash_queue.live.LiveShards) connects to the run's server, and only while it is up.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dflash_queue.broker.redis_server import RedisServer
from dflash_queue.config import BrokerConfig, Config, RunConfig
from dflash_queue.doctor.broker import broker_problem
from dflash_queue.errors import ConfigError
from dflash_queue.queue.child_guard import BROKER, ChildGuard

URL_FILE = "broker.url"


def private_broker_dir(run: RunConfig) -> Path:
    return Path(run.state_dir) / "redis"


def private_server(run: RunConfig, broker: BrokerConfig) -> RedisServer:
    """The run's private redis-server (not started), asking for the broker's password when one is set (the
    default user's, and broker.username's as a least-rights worker user), so workers log in as they would
    anywhere else."""
    password = broker.password()
    users = {broker.username: password} if password is not None and broker.username else {}
    return RedisServer(private_broker_dir(run), password=password, users=users)


def record_url(directory: Path, url: str) -> None:
    """`run`: the URL of its private server, for the commands above while it runs; renamed into place whole, since
    a trainer waiting for the run reads the file the moment it appears."""
    path = directory / URL_FILE
    partial = path.with_name(f".{URL_FILE}.{os.getpid()}.partial")
    partial.write_text(url + "\n", encoding="utf-8")
    os.replace(partial, path)


def forget_url(directory: Path) -> None:
    (directory / URL_FILE).unlink(missing_ok=True)


def _answering(broker: BrokerConfig, source: str) -> bool:
    """Whether the run's server at `broker.url` is up; ConfigError (naming the config file `source`) when it is but
    refuses the configured login (starting another server on its data would put two servers on one AOF)."""
    problem = broker_problem(broker.connection_url(), password_from=broker.password_origin(), timeout_s=1.0)
    if problem is not None and problem.refused:
        raise ConfigError(f"{source}: {problem.message}")
    return problem is None


def running_broker(config: Config, *, wait_s: float = 0.0, poll_s: float = 0.5) -> Config:
    """`config` with the URL of the private broker of the `dflash-queue run` running this job now (what a trainer
    following the run connects to), waited for up to `wait_s` (a trainer started just after the run); ConfigError
    when none answers by then, saying what to start or set. Whole Config in and out: the caller's, its broker set."""
    url_file = private_broker_dir(config.run) / URL_FILE
    deadline = time.monotonic() + wait_s
    while True:
        live = url_file.read_text(encoding="utf-8").strip() if url_file.is_file() else ""
        if live:
            running = config.with_overrides(broker={"url": live})
            if _answering(running.broker, config.source):
                return running
        if time.monotonic() >= deadline:
            raise ConfigError(
                f"{config.source}: broker.url is empty and no `dflash-queue run` of this job is running (nothing "
                f"answers at {url_file} after {wait_s:.0f} s): start `dflash-queue run DATASET -c {config.source}` "
                "first (run again, it resumes the job and extracts the epochs a trainer asks for), or set broker.url "
                "(or DFQ_BROKER_URL) to the job's broker"
            )
        time.sleep(poll_s)


def _has_data(directory: Path) -> bool:
    return (directory / "appendonlydir").is_dir() or (directory / "appendonly.aof").is_file()


@contextmanager
def broker_for_reading(config: Config, what: str) -> Iterator[Config]:
    """`config` with a broker URL to read from: its own, else that of the job `run` ran (see the module
    docstring). ConfigError when there is neither, saying what to set. Whole Config in and out: the caller's, its
    broker set."""
    if config.broker.url:
        yield config
        return
    directory = private_broker_dir(config.run)
    url_file = directory / URL_FILE
    live = url_file.read_text(encoding="utf-8").strip() if url_file.is_file() else ""
    if live:
        running = config.with_overrides(broker={"url": live})
        if _answering(running.broker, config.source):
            yield running
            return
    if not _has_data(directory):
        raise ConfigError(
            f"{config.source}: broker.url is empty and {directory} holds no data of a `dflash-queue run` job: {what} "
            "reads the broker; set broker.url (or DFQ_BROKER_URL)"
        )
    with ChildGuard() as guard:  # a command killed while it reads leaves no server behind
        server = private_server(config.run, config.broker).start()
        assert server.process is not None
        guard.watch("redis-server", server.process.pid, role=BROKER)
        try:
            yield config.with_overrides(broker={"url": server.url})
        finally:
            server.stop()
