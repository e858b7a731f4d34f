"""The `dflash-queue` command line. Each command group lives in its own module."""

from __future__ import annotations

import click

from dflash_queue import __version__
from dflash_queue.cli import audit, monitor, ops, pipeline, plan, reliability, shards, suspects

# Modules of the optional extras (pyproject.toml), and the extra that installs each.
EXTRA_OF_MODULE = {
    "celery": "worker",
    "kombu": "worker",
    "redis": "worker",
    "transformers": "worker",
    "tokenizers": "worker",
    "pyarrow": "worker",
    "zstandard": "worker",
    "vllm": "vllm",
    "boto3": "s3",
    "botocore": "s3",
    "flower": "ops",
    "matplotlib": "ops",
    "prometheus_client": "ops",
}


class Commands(click.Group):
    """Commands whose optional dependencies are missing say which extra to install."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except ModuleNotFoundError as exc:
            extra = EXTRA_OF_MODULE.get((exc.name or "").split(".")[0])
            if extra is None:
                raise
            raise click.ClickException(
                f"this command needs {exc.name}, which the `{extra}` extra installs: pip install 'dflash-queue[{extra}]'"
            ) from None


@click.group(cls=Commands, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="dflash-queue")
def main() -> None:
    """Regenerate a prompt dataset with the target model and extract its hidden states for drafter training."""


for module in (pipeline, audit, shards, ops, monitor, plan, reliability, suspects):
    for command in module.COMMANDS:
        main.add_command(command)
