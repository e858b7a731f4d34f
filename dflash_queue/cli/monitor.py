"""Commands that look at a node or a run: status, metrics and doctor."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click
from rich.console import Console
from rich.text import Text

from dflash_queue.cli.common import architecture_options, config_option, load, model_overrides, reading_broker

VERDICT_STYLE = {"pass": "green", "warn": "yellow", "fail": "bold red"}


@click.command()
@config_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON snapshot instead of a table.")
@click.option("--watch", is_flag=True, help="Refresh the table in place until Ctrl-C.")
@click.option("--interval", type=click.FloatRange(min=0.5), default=5.0, show_default=True,
              help="Seconds between refreshes with --watch.")
@click.option("--window", "window_min", type=click.FloatRange(min=1, max=360), default=10.0, show_default=True,
              help="Minutes of recent progress the throughput and ETA are measured over.")
@click.option("--timeout", type=click.FloatRange(min=0.1), default=1.0, show_default=True,
              help="Seconds to wait for workers to answer.")
def status(config_path: Path, as_json: bool, watch: bool, interval: float, window_min: float, timeout: float) -> None:
    """Per lane: queue depth, tasks in flight, workers alive, progress, throughput and ETA."""
    import redis

    from dflash_queue.ops.status import collect_status
    from dflash_queue.ops.status_view import status_table

    config = reading_broker(load(config_path), "status")

    def snapshot():
        try:
            return collect_status(config, window_s=window_min * 60, inspect_timeout=timeout)
        except redis.RedisError as exc:
            raise click.ClickException(f"broker {config.broker.url}: {exc}") from None

    if as_json:
        click.echo(json.dumps(snapshot().to_json(), indent=2, sort_keys=True))
        return
    console = Console()
    if not watch:
        console.print(status_table(snapshot()))
        return
    try:
        if console.is_terminal:
            from rich.live import Live

            with Live(status_table(snapshot()), console=console, auto_refresh=False) as live:
                while True:
                    time.sleep(interval)
                    live.update(status_table(snapshot()), refresh=True)
        else:  # a log or a pipe: one table after another
            while True:
                console.print(status_table(snapshot()))
                time.sleep(interval)
    except KeyboardInterrupt:
        pass


@click.command()
@config_option
@click.option("--port", type=click.IntRange(1, 65535), default=9464, show_default=True,
              help="Port of the /metrics endpoint.")
@click.option("--address", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0: every interface, for a Prometheus on another host).")
@click.option("--window", "window_min", type=click.FloatRange(min=1, max=360), default=10.0, show_default=True,
              help="Minutes of recent progress the rates and ETAs are measured over, as for status.")
@click.option("--timeout", type=click.FloatRange(min=0.1), default=1.0, show_default=True,
              help="Seconds to wait for workers to answer.")
@click.option("--cache", "cache_s", type=click.FloatRange(min=0), default=5.0, show_default=True,
              help="Seconds a snapshot serves scrapes before the next is taken.")
def metrics(config_path: Path, port: int, address: str, window_min: float, timeout: float, cache_s: float) -> None:
    """Serve the run's figures (those of status) to Prometheus on http://ADDRESS:PORT/metrics until Ctrl-C."""
    import threading

    from dflash_queue.ops.metrics import StatusCollector, serve_metrics
    from dflash_queue.ops.status import collect_status
    from dflash_queue.stop_signals import stopped_by_signals

    config = reading_broker(load(config_path), "metrics")
    collector = StatusCollector(
        config.run.name,
        lambda: collect_status(config, window_s=window_min * 60, inspect_timeout=timeout),
        cache_s=cache_s,
    )
    try:
        server, _ = serve_metrics(collector, address=address, port=port)
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {address}:{port}: {exc}") from None
    click.echo(f"run {config.run.name}: metrics on http://{address}:{port}/metrics", err=True)
    try:
        with stopped_by_signals():  # SIGTERM and SIGHUP as Ctrl-C: the broker a finished job's data needs stops
            threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()


@click.command()
@config_option
@click.option("--json", "as_json", is_flag=True, help="Print the checks as JSON.")
@click.option("--warn-below-gb", type=float, default=20.0, show_default=True, help="Warn below this much free disk.")
@click.option("--fail-below-gb", type=float, default=1.0, show_default=True, help="Fail below this much free disk.")
@click.option(
    "--skip-engine-start", is_flag=True,
    help="Do not start the vLLM extract engine (to compare its states with the checkpoint's own forward): for a "
    "node whose workers hold its GPUs.",
)
@architecture_options
def doctor(
    config_path: Path,
    as_json: bool,
    warn_below_gb: float,
    fail_below_gb: float,
    skip_engine_start: bool,
    model_config: Path | None,
    tokenizer_dir: Path | None,
) -> None:
    """Preflight checks of this node for CONFIG, one per line; exits 1 if any fails."""
    from dflash_queue.doctor.preflight import run_doctor

    config = load(config_path, model=model_overrides(model_config, tokenizer_dir))
    checks = run_doctor(
        config, warn_below_gb=warn_below_gb, fail_below_gb=fail_below_gb, start_engine=not skip_engine_start
    )
    failed = sum(c.verdict == "fail" for c in checks)
    if as_json:
        click.echo(json.dumps([c.__dict__ for c in checks], indent=2))
    else:
        console = Console(highlight=False, soft_wrap=True)
        width = max(len(c.name) for c in checks)
        for check in checks:
            console.print(
                Text.assemble(
                    (f"{check.verdict.upper():4}", VERDICT_STYLE[check.verdict]),
                    f"  {check.name:<{width}}  {check.detail}",
                )
            )
        warned = sum(c.verdict == "warn" for c in checks)
        console.print(f"{len(checks) - failed - warned} passed, {warned} warnings, {failed} failed")
    sys.exit(1 if failed else 0)


COMMANDS = [status, metrics, doctor]
