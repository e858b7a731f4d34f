"""Commands for what failed: dead letters (list, show, requeue, purge) and `verify`."""

from __future__ import annotations

import json
import re
import sys
from dataclasses import asdict
from pathlib import Path

import click

from dflash_queue.cli.common import config_option, load, reading_broker
from dflash_queue.lanes.registry import LANES, UNKNOWN_LANE

AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_age(value: str | None, option: str) -> float | None:
    if value is None:
        return None
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", value)
    if not match:
        raise click.BadParameter(f"{value!r}: expected a number with s, m, h or d (30m, 2h, 1d)", param_hint=option)
    return float(match.group(1)) * AGE_UNITS[match.group(2) or "s"]


def filter_options(command):
    for option in reversed(
        [
            click.option("--lane", type=click.Choice([*LANES, UNKNOWN_LANE]), help="Only this lane."),
            click.option("--exception", "exc_type", help="Only this exception type (e.g. InjectedFault)."),
            click.option("--kind", type=click.Choice(["task", "sample", "message"]), help="Only this kind."),
            click.option("--older-than", help="Only records whose last failure is at least this old (2h)."),
            click.option("--newer-than", help="Only records whose last failure is at most this old (30m)."),
        ]
    ):
        command = option(command)
    return command


def _open(config_path: Path):
    from dflash_queue.deadletters import DeadLetters

    config = reading_broker(load(config_path), "dead (dead letters live on the broker)")
    return config, DeadLetters.from_url(config.broker.connection_url(), config.run.name)


def _select(dead, ids, lane, exc_type, kind, older_than, newer_than):
    from dflash_queue.deadletters import Filter

    where = Filter(
        lane=lane,
        exc_type=exc_type,
        kind=kind,
        older_than_s=parse_age(older_than, "--older-than"),
        newer_than_s=parse_age(newer_than, "--newer-than"),
    )
    return dead.select(where, ids)


@click.group()
def dead() -> None:
    """Dead letters: tasks, samples and messages that failed for good, kept until requeued or purged."""


@dead.command("list")
@config_option
@filter_options
@click.option("--json", "as_json", is_flag=True, help="A JSON array of the dead letters ([] when there are none).")
def dead_list(config_path, lane, exc_type, kind, older_than, newer_than, as_json) -> None:
    """List dead letters, oldest first, and how many there are."""
    _, store = _open(config_path)
    records = _select(store, (), lane, exc_type, kind, older_than, newer_than)
    if as_json:
        click.echo(json.dumps([asdict(record) for record in records], indent=1))
        return
    for record in records:
        click.echo(record.summary())
    click.echo(f"{len(records)} dead letter(s)")


@dead.command("show")
@config_option
@click.argument("record_id")
def dead_show(config_path, record_id) -> None:
    """Everything recorded about one dead letter, traceback included."""
    _, store = _open(config_path)
    record = store.get(record_id)
    if record is None:
        raise click.ClickException(f"no dead letter {record_id!r}")
    for name, value in asdict(record).items():
        if name != "traceback":
            click.echo(f"{name}: {json.dumps(value) if isinstance(value, (list, dict)) else value}")
    click.echo("traceback:\n" + record.traceback)


@dead.command("requeue")
@config_option
@click.argument("record_ids", nargs=-1)
@filter_options
@click.option("--all", "everything", is_flag=True, help="Requeue every record the filters match.")
@click.option("--dry-run", is_flag=True, help="Say what would be sent; send nothing.")
def dead_requeue(config_path, record_ids, lane, exc_type, kind, older_than, newer_than, everything, dry_run) -> None:
    """Send dead letters' work again (after fixing the cause): RECORD_IDS, or --all matching the filters."""
    from dflash_queue.deadletters.requeue import celery_send, requeue
    from dflash_queue.queue.app import configure_app
    from dflash_queue.runstate.ledger import Ledger

    if not record_ids and not everything:
        raise click.UsageError("name record ids, or pass --all (with filters) to requeue every match")
    config, store = _open(config_path)
    records = _select(store, record_ids, lane, exc_type, kind, older_than, newer_than)
    missing = set(record_ids) - {r.id for r in records}
    for record_id in sorted(missing):
        click.echo(f"gone: {record_id}: no such dead letter (or filtered out)", err=True)
    app = configure_app(config)
    ledger = Ledger.from_url(config.broker.connection_url(), config.run.name)
    for outcome in requeue(config.run, config.fingerprint(), store, ledger, records, celery_send(app), dry_run=dry_run):
        click.echo(outcome.line())


@dead.command("purge")
@config_option
@click.argument("record_ids", nargs=-1)
@filter_options
@click.option("--all", "everything", is_flag=True, help="Purge every record the filters match.")
@click.option("--dry-run", is_flag=True, help="List what would be purged; purge nothing.")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
def dead_purge(config_path, record_ids, lane, exc_type, kind, older_than, newer_than, everything, dry_run, yes) -> None:
    """Delete dead letters for good (their samples count as missing in `verify`)."""
    if not record_ids and not everything:
        raise click.UsageError("name record ids, or pass --all (with filters) to purge every match")
    _, store = _open(config_path)
    records = _select(store, record_ids, lane, exc_type, kind, older_than, newer_than)
    for record in records:
        click.echo(("would purge: " if dry_run else "") + record.summary())
    if dry_run or not records:
        click.echo(f"{len(records)} dead letter(s) {'would be ' if dry_run else ''}purged", err=True)
        return
    if not yes:
        click.confirm(f"purge {len(records)} dead letter(s)?", abort=True)
    removed = store.remove(r.id for r in records)
    click.echo(f"{removed} dead letter(s) purged", err=True)


@click.command()
@click.argument("datasets", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@config_option
@click.option("--epoch", type=click.IntRange(min=0), default=0, show_default=True,
              help="The epoch to account for: 0 is the run's shards, later ones were extracted again (`epoch`).")
def verify(datasets: tuple[Path, ...], config_path: Path, epoch: int) -> None:
    """Check every sample of DATASETS is accounted for exactly once: done, flagged, dropped, filtered or dead.

    Lists the missing and the duplicated; exits 1 if there are any.
    """
    from dflash_queue.verify import verify as run_verify

    config = reading_broker(load(config_path), "verify (the ledger and dead letters live on the broker)")
    report = run_verify(config, list(datasets), epoch=epoch)
    for line in report.lines():
        click.echo(line)
    click.echo("verify: OK" if report.ok else "verify: FAILED", err=True)
    sys.exit(0 if report.ok else 1)


COMMANDS = [dead, verify]
