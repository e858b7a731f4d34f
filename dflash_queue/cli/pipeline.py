"""Commands that move work: enqueue, worker, run, reextract, epoch."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from dflash_queue.cli.common import broker_ready, config_option, load
from dflash_queue.errors import ConfigError, DflashQueueError
from dflash_queue.lanes.registry import LANES

datasets_argument = click.argument(
    "datasets", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path)
)


@click.command()
@datasets_argument
@config_option
@click.option(
    "--rebuild",
    is_flag=True,
    help="The broker was lost or restored from an old copy: ignore the ledger and enqueue every shard whose "
    "training file is not in storage (tasks are idempotent: a shard that still had a message is stored once). "
    "A run name made with another config is started over with this one.",
)
def enqueue(datasets: tuple[Path, ...], config_path: Path, rebuild: bool) -> None:
    """Stage DATASETS as prompt shards and enqueue one generate task per shard not already done or queued."""
    from dflash_queue.producer import Producer
    from dflash_queue.queue.app import configure_app
    from dflash_queue.runstate.ledger import Ledger

    config = broker_ready(load(config_path), "enqueue")
    try:
        configure_app(config)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    console = Console(stderr=True, soft_wrap=True)
    ledger = Ledger.from_url(config.broker.connection_url(), config.run.name)
    try:
        producer = Producer(config, ledger)
    except ConfigError as exc:  # a thinking policy the template cannot honour: nothing staged
        raise click.ClickException(str(exc)) from None
    with Progress(TextColumn("enqueue"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console) as bar:
        task = bar.add_task("samples", total=None)
        try:
            report = producer.enqueue(
                list(datasets),
                on_shard=lambda n: bar.advance(task, n),
                on_total=lambda n: bar.update(task, total=n),  # known once the files are read
                rebuild=rebuild,
            )
        except ConfigError as exc:  # other settings, or a dataset refused (DatasetRefused says what was sent)
            raise click.ClickException(str(exc)) from None
    for line in report.lines():
        click.echo(line)


@click.command()
@click.argument("lane", type=click.Choice(list(LANES)))
@config_option
@click.option(
    "--concurrency",
    type=click.IntRange(min=1),
    default=None,
    help="Task slots (threads). Default: generate.vllm.inflight_tasks for the vLLM engine, 1 for the Transformers "
    "engine; 1 + storage.uploader.max_pending for extract, so that uploads overlap the next shard's compute.",
)
@click.option(
    "-n", "--hostname", default=None,
    help="Celery node name (default LANE-RUN@HOST; LANE-RUN-gpuGROUP@HOST for a worker given GPUs by --gpus or "
    "CUDA_VISIBLE_DEVICES, e.g. extract-myrun-gpu0-3@node). A worker whose name a live worker holds is refused.",
)
@click.option("-l", "--loglevel", default="INFO", show_default=True)
@click.option(
    "--gpus",
    default=None,
    help="GPUs of this worker (CUDA_VISIBLE_DEVICES): 0, a range 0-3, a list 0,2 (or 0_2, as in a systemd "
    "instance name); a vLLM lane's group has exactly its vllm.tensor_parallel_size GPUs, the Transformers extract "
    "engine spreads its layers over its group. Indices this node does not have are refused.",
)
def worker(
    lane: str, config_path: Path, concurrency: int | None, hostname: str | None, loglevel: str, gpus: str | None
) -> None:
    """Run a LANE worker: load the engine once, then consume the lane's queue until stopped (SIGTERM)."""
    from dflash_queue.lanes.tensor_parallel import group_size_error, vllm_tensor_parallel

    config = load(config_path)
    if gpus is not None:
        from dflash_queue.ops.gpus import missing_gpus_error, node_gpus, parse_gpu_group, visible_devices

        try:
            group = parse_gpu_group(gpus)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--gpus") from None
        tensor_parallel = vllm_tensor_parallel(config.generate, config.extract).get(lane)
        error = group_size_error(lane, group, tensor_parallel) if tensor_parallel is not None else None
        error = error or missing_gpus_error(group, node_gpus())
        if error:
            raise click.BadParameter(f"{gpus}: {error}", param_hint="--gpus")
        # Before anything can initialise CUDA: the engine sees only these GPUs, renumbered from 0.
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices(group)
        click.echo(f"GPUs {visible_devices(group)} (CUDA_VISIBLE_DEVICES)", err=True)
    from dflash_queue.queue.worker import default_node_name, run_worker

    hostname = hostname or default_node_name(lane, config.run.name, _gpu_label(os.environ))
    if not config.broker.url:
        raise click.ClickException(f"{config_path}: broker.url is empty; workers need a broker (or DFQ_BROKER_URL)")
    from dflash_queue.run_lock import refuse_foreign_worker

    try:
        refuse_foreign_worker(config.run.state_dir, config.run.name)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    try:
        code = run_worker(config, lane, concurrency=concurrency, hostname=hostname, loglevel=loglevel)
    except DflashQueueError as exc:  # storage check failed, bad storage settings: say why and exit non-zero
        raise click.ClickException(str(exc)) from None
    sys.exit(code)


def _gpu_label(environ: Mapping[str, str]) -> str:
    """The worker's GPUs as its default node name carries them: CUDA_VISIBLE_DEVICES (set by --gpus, or by the
    environment) in the systemd instance form ("0,1,2,3" -> "0-3"); device names that are not indices (GPU UUIDs)
    as they are, any character other than a letter, digit, "-" or "_" replaced by "_"; "" without GPUs."""
    from dflash_queue.ops.gpus import instance_name, parse_gpu_group

    devices = environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if not devices:
        return ""
    try:
        return instance_name(parse_gpu_group(devices))
    except ValueError:
        return re.sub(r"[^A-Za-z0-9_-]", "_", devices)


@click.command()
@datasets_argument
@config_option
@click.option("-o", "--output", default=None, help="Storage for this run (directory or URL); overrides storage.url.")
@click.option(
    "--rebuild",
    is_flag=True,
    help="Ignore the ledger: enqueue every shard whose training file is not in storage; a run name made with "
    "another config is started over with this one.",
)
def run(datasets: tuple[Path, ...], config_path: Path, output: str | None, rebuild: bool) -> None:
    """Run the whole job on this machine: broker, one worker per lane, enqueue, wait, summary."""
    from dflash_queue import faults

    config = load(config_path, storage_url=output)
    if config.broker.url:  # else a private broker, started by the run itself
        broker_ready(config, "run")
    try:
        faults.refuse_uninstalled()
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    _run_job(config_path, config, list(datasets), rebuild=rebuild)


def _run_job(config_path: Path, config, datasets: list[Path], **options) -> None:
    from dflash_queue.run_lock import RunLock

    # Taken before the heavy imports below (Celery, Transformers, torch): a second run of the same state directory
    # is refused at once, not after them.
    lock = RunLock(config.run.state_dir, config.run.name)
    try:
        lock.acquire()
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    try:
        _run_locked(config_path, config, datasets, lock=lock, **options)
    finally:
        lock.release()


def _run_locked(config_path: Path, config, datasets: list[Path], **options) -> None:
    from dflash_queue.single_box import RunFailed, run_single_box
    from dflash_queue.stop_signals import StopRequested

    console = Console(stderr=True, soft_wrap=True)
    try:
        summary = run_single_box(config_path, config, datasets, console=console, **options)
    except (RunFailed, ConfigError) as exc:
        raise click.ClickException(str(exc)) from None
    except KeyboardInterrupt as stop:  # Ctrl-C, kill -INT, SIGTERM, SIGHUP: see dflash_queue/stop_signals.py
        name = stop.name if isinstance(stop, StopRequested) else "SIGINT"
        console.print(f"interrupted ({name}): workers and broker stopped; queued work is kept for the next run")
        sys.exit(stop.exit_code if isinstance(stop, StopRequested) else 130)
    for line in summary.lines():
        click.echo(line)
    if summary.shards_failed or summary.shards_missing or summary.shards_suspect:
        sys.exit(1)


@click.command()
@config_option
@click.option(
    "--from", "from_path", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="The config of the job whose stored completions are extracted again (its storage is read, never written).",
)
@click.option("-o", "--output", default=None, help="Storage for the new output (directory or URL); overrides storage.url.")
def reextract(config_path: Path, from_path: Path, output: str | None) -> None:
    """Extract the stored completions of the job FROM made again with this config's extract settings (layers,
    last_layer_state, hidden_dtype, engine) into a new output, on this machine as `run` does: nothing is generated
    again. Only extract settings may differ from FROM's; the new output's fingerprint is this config's."""
    from dflash_queue import faults

    config = load(config_path, storage_url=output)
    source = load(from_path)
    if config.broker.url:
        broker_ready(config, "reextract")
    try:
        faults.refuse_uninstalled()
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    _run_job(config_path, config, [], reextract_from=source)


@click.command()
@config_option
@click.option("--epoch", "number", type=click.IntRange(min=1), default=None,
              help="The epoch to start; default: the one after the latest started.")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Seeds the epoch's order of extraction (a live dataset reads in its own seed's order).")
@click.option("--resend", is_flag=True,
              help="Send again the epoch's shards not yet extracted (after a producer that stopped half-way); the "
              "extract lane skips any stored after all.")
def epoch(config_path: Path, number: int | None, seed: int, resend: bool) -> None:
    """Start the next epoch of a run trained while it extracts: every done shard is extracted again from its stored
    completions (nothing is generated), in an order of its own, into epochs/EPOCH/shards/. It starts once the
    previous epoch's extraction is over. A live dataset (dflash_queue.live.LiveShards with epochs > 1) starts
    epochs itself."""
    from dflash_queue.live.epochs import start_epoch
    from dflash_queue.runstate.ledger import Ledger
    from dflash_queue.runstate.window import ShardWindow

    config = broker_ready(load(config_path), "epoch")
    ledger = Ledger.from_url(config.broker.connection_url(), config.run.name)
    consumption = ShardWindow(ledger.client, config.run.name)
    if number is None:
        number = consumption.last_epoch() + (0 if resend else 1)
        if number == 0:
            raise click.ClickException("epoch 0 is the run itself: --resend sends a later epoch's shards again")
    try:
        report = start_epoch(config, number, seed=seed, consumption=consumption, ledger=ledger, resend=resend)
    except DflashQueueError as exc:
        raise click.ClickException(str(exc)) from None
    for line in report.lines():
        click.echo(line)
    sys.exit(0 if report.started else 1)


COMMANDS = [enqueue, worker, run, reextract, epoch]
