"""Commands over the shards the reference audit found suspect: list them, extract them again."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from dflash_queue.cli.common import config_option, load, reading_broker

WHAT = "suspects (the audit's records live on the broker)"


def _open(config_path: Path):
    from dflash_queue.runstate.audits import AuditRecords
    from dflash_queue.runstate.ledger import resilient_client
    from dflash_queue.storage import open_storage

    config = reading_broker(load(config_path), WHAT)
    client = resilient_client(config.broker.connection_url())
    return config, client, AuditRecords(client, config.run.name), open_storage(config.storage)


@click.group()
def suspects() -> None:
    """Training shards a failed reference audit made suspect: no reader serves them as good until they are
    extracted again."""


@suspects.command("list")
@config_option
@click.option("--json", "as_json", is_flag=True, help="A JSON array of the suspect shards ([] when there are none).")
def suspects_list(config_path: Path, as_json: bool) -> None:
    """Every suspect shard, oldest first: its epoch, the worker that stored it, why, and who consumed it before it
    turned suspect."""
    from dflash_queue.suspects import find_suspects

    _, _, records, storage = _open(config_path)
    found = find_suspects(records, storage)
    if as_json:
        click.echo(json.dumps([s.to_json() for s in found], indent=1))
        return
    for suspect in found:
        consumed = f"; consumed before it turned suspect by {suspect.consumed()}" if suspect.consumed_by else ""
        click.echo(f"{suspect.name}: {suspect.describe()}{consumed}")
    click.echo(
        f"{len(found)} suspect shard(s), {sum(bool(s.consumed_by) for s in found)} consumed before they turned suspect"
    )


@suspects.command("reextract")
@config_option
@click.option("--json", "as_json", is_flag=True, help="A JSON array of what became of each suspect shard.")
@click.option("--resend", is_flag=True, help="Send again a shard an earlier re-extraction sent that is not stored yet.")
@click.option("--dry-run", is_flag=True, help="Say what would be sent; send nothing.")
def suspects_reextract(config_path: Path, as_json: bool, resend: bool, dry_run: bool) -> None:
    """Send every suspect shard to the extract lane again (redo, in its epoch), its state set back to waiting for
    extraction; the marks stay until the new shard is stored. A shard whose completions are gone is refused (exit 1).
    """
    from dflash_queue.lanes.registry import FINAL_LANE
    from dflash_queue.queue.app import configure_app
    from dflash_queue.queue.tasks import send_to_lane
    from dflash_queue.runstate.ledger import Ledger
    from dflash_queue.suspects import find_suspects, reextract

    config, client, records, storage = _open(config_path)
    configure_app(config)

    def send(shard_id: str, num_samples: int, fingerprint: str, epoch: int) -> None:
        send_to_lane(FINAL_LANE.name, shard_id, num_samples, fingerprint, redo=True, epoch=epoch)

    report = reextract(
        config.run.name, config.fingerprint(), find_suspects(records, storage), ledger=Ledger(client, config.run.name),
        storage=storage, send=send, resend=resend, dry_run=dry_run,
    )
    if as_json:
        click.echo(json.dumps([o.__dict__ for o in report.outcomes], indent=1))
    else:
        for line in report.lines():
            click.echo(line)
    sys.exit(1 if report.refused else 0)


COMMANDS = [suspects]
