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


def load(config_path: Path, *, storage_url: str | None = None, model: dict[str, str] | None = None) -> Config:
    """Load the config or exit with its message (file, key, what is wrong)."""
    env = dict(os.environ)
    if storage_url:
        env[STORAGE_URL_ENV] = str(Path(storage_url).resolve()) if "://" not in storage_url else storage_url
    try:
        return load_config(config_path, env=env, model=model)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None


def broker_ready(config: Config, what: str) -> Config:
    """`config`, once its broker lets this command in: what every command that talks to the broker calls first.
    Else exit with one line naming the setting to fix (broker.url, the password's variable or file,
    broker.username), within a few seconds and without a traceback: a refused login, no password given, no answer.
    (Left alone, the clients behind Celery retry a refused login as they would a broker that is down: minutes of
    silence, then a traceback.)"""
    from dflash_queue.doctor.broker import broker_problem

    if not config.broker.url:
        raise click.ClickException(
            f"{config.source}: broker.url is empty: {what} needs the broker; set broker.url (or DFQ_BROKER_URL)"
        )
    try:
        url = config.broker.connection_url()
    except ConfigError as exc:  # a password file that cannot be read
        raise click.ClickException(str(exc)) from None
    problem = broker_problem(url, password_from=config.broker.password_origin())
    if problem is not None:
        raise click.ClickException(problem.message)
    return config


def reading_broker(config: Config, what: str) -> Config:
    """`config` with the broker `what` reads: its own, or that of the job `dflash-queue run` ran with an empty
    broker.url (broker/run_broker.py), kept up until the command ends, once it lets this command in; or exit saying what
    to set."""
    from dflash_queue.broker.run_broker import broker_for_reading

    try:
        config = click.get_current_context().with_resource(broker_for_reading(config, what))
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    return broker_ready(config, what.split(" ", 1)[0])


def architecture_options(command):
    """--model-config and --tokenizer: a config whose weights are not on this machine, checked or planned with
    its target's architecture (a checkpoint's config.json, e.g. examples/qwen3.6-27b-class) and a tokenizer."""
    command = click.option(
        "--tokenizer", "tokenizer_dir", type=click.Path(exists=True, path_type=Path), default=None,
        help="A tokenizer (directory) to use instead of model.tokenizer / model.path.",
    )(command)
    return click.option(
        "--model-config", "model_config", type=click.Path(exists=True, path_type=Path), default=None,
        help="The target's architecture (a directory holding its config.json, weights not needed) instead of "
        "model.path.",
    )(command)


def model_overrides(model_config: Path | None, tokenizer_dir: Path | None) -> dict[str, str]:
    overrides = {}
    if model_config is not None:
        overrides["path"] = str(model_config.parent if model_config.is_file() else model_config)
    if tokenizer_dir is not None:
        overrides["tokenizer"] = str(tokenizer_dir)
    return overrides

