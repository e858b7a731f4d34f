"""Flower against the configured broker: task events on, basic auth from the environment, bounded memory."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from dflash_queue.config import Config, FlowerConfig, RunConfig
from dflash_queue.errors import ConfigError

AUTH_ENV = "FLOWER_BASIC_AUTH"


def check_basic_auth(env: Mapping[str, str] = os.environ) -> list[str]:
    """The users of FLOWER_BASIC_AUTH (`user:password[,user2:password2]`); a clear error when unusable.

    Flower reads the variable itself, so the password never appears on a command line.
    """
    value = env.get(AUTH_ENV, "")
    if not value:
        raise ConfigError(
            f"{AUTH_ENV} is not set: Flower's API answers every request without it. Set it to user:password "
            f"(the environment file written by `dflash-queue systemd install` has one)"
        )
    users = []
    for index, entry in enumerate(value.split(",")):
        user, sep, password = entry.partition(":")
        if not sep or not user or not password:
            raise ConfigError(f"{AUTH_ENV}: entry {index + 1} is not user:password (both non-empty)")
        users.append(user)
    return users


def flower_argv(
    settings: FlowerConfig, run: RunConfig, *, port: int | None = None, address: str | None = None
) -> list[str]:
    """Arguments of Celery's `flower` command for these settings (its database in the run's state directory by
    default)."""
    argv = [
        "flower",
        f"--address={settings.address if address is None else address}",
        f"--port={settings.port if port is None else port}",
        f"--max_tasks={settings.max_tasks}",
        f"--persistent={settings.persistent}",
        # Events are what Flower shows; it re-enables them on workers that were started without.
        "--enable_events=True",
    ]
    if settings.persistent:
        db = settings.db or str(Path(run.state_dir) / "flower.db")
        Path(db).parent.mkdir(parents=True, exist_ok=True)
        argv.append(f"--db={db}")
    if settings.purge_offline_workers_s:
        argv.append(f"--purge_offline_workers={settings.purge_offline_workers_s}")
    return argv


def run_flower(config: Config, argv: list[str]) -> int | None:
    """Run Flower in this process until SIGTERM/Ctrl-C. Takes the whole Config: the Celery app is configured from
    it (queue/app.py)."""
    from dflash_queue.queue.app import configure_app

    app = configure_app(config)
    return app.start(argv)
