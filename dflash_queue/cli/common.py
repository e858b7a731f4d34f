"""Options and helpers shared by commands."""

from __future__ import annotations

import os
from pathlib import Path

import click

from dflash_queue.config import STORAGE_URL_ENV, Config, load_config
from dflash_queue.errors import ConfigError

config_option = click.option(
    "-c",
    "--config",
    "config_path",
    required=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Deployment config (TOML), e.g. worker_configs/local-cpu.toml.",
)


def load(config_path: Path, *, storage_url: str | None = None) -> Config:
    """Load the config or exit with its message (file, key, what is wrong)."""
    env = dict(os.environ)
    if storage_url:
        env[STORAGE_URL_ENV] = str(Path(storage_url).resolve()) if "://" not in storage_url else storage_url
    try:
        return load_config(config_path, env=env)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None


def reading_broker(config: Config, what: str) -> Config:
    """`config` with the broker `what` reads: its own, or that of the job `dflash-queue run` ran with an empty
    broker.url (run_broker.py), kept up until the command ends; or exit saying what to set."""
    from dflash_queue.run_broker import broker_for_reading

    try:
        return click.get_current_context().with_resource(broker_for_reading(config, what))
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None

