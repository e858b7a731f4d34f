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


def reading_broker(config: Config, what: str) -> Config:
    """`config` with the broker `what` reads: its own, or that of the job `dflash-queue run` ran with an empty
    broker.url (run_broker.py), kept up until the command ends; or exit saying what to set."""
    from dflash_queue.run_broker import broker_for_reading

    try:
        return click.get_current_context().with_resource(broker_for_reading(config, what))
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None


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

