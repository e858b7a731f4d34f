"""The `dflash-queue` command line. Each command group lives in its own module."""

from __future__ import annotations

import click

from dflash_queue import __version__
from dflash_queue.cli import audit, monitor, ops, pipeline, plan, reliability, shards


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="dflash-queue")
def main() -> None:
    """Regenerate a prompt dataset with the target model and extract its hidden states for drafter training."""


for module in (pipeline, audit, shards, ops, monitor, plan, reliability):
    for command in module.COMMANDS:
        main.add_command(command)
