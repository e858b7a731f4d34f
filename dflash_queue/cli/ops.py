"""Commands that run the service on a node: systemd units and Flower."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from dflash_queue.cli.common import broker_ready, config_option, load
from dflash_queue.errors import ConfigError
from dflash_queue.lanes.registry import LANES
from dflash_queue.lanes.tensor_parallel import vllm_tensor_parallel


def _groups(value: str | None, option: str) -> tuple[tuple[int, ...], ...]:
    from dflash_queue.ops.gpus import parse_gpu_groups

    if not value:
        return ()
    try:
        return parse_gpu_groups(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint=option) from None


@click.group()
def systemd() -> None:
    """systemd units: one worker per GPU (or tensor-parallel group) and lane, Flower, and dflash.target."""


def _lane_group_options(command):
    """One --LANE option per lane of the registry: that lane's workers' GPU groups."""
    for lane in reversed(LANES):
        command = click.option(
            f"--{lane}",
            f"{lane}_groups",
            default=None,
            help=f"{lane.capitalize()} workers' GPU groups, comma-separated: 0,1 (two workers), 0-3,4-7 (ranges), "
            "0_2 (GPUs 0 and 2).",
        )(command)
    return command


@systemd.command("install")
@config_option
@click.option("--gpus", default=None, help="This node's GPUs, a count (8) or a list (0,1,2,3 or 0-3); checks the layout.")
@_lane_group_options
@click.option("--flower/--no-flower", default=True, show_default=True, help="Also install dflash-flower.service.")
@click.option("--dest", type=click.Path(file_okay=False, path_type=Path), default=Path("/etc/systemd/system"),
              show_default=True, help="Where the unit files go.")
@click.option("--env-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Environment file for the units [default: /etc/dflash-queue/dflash.env].")
@click.option("--exec", "exec_command", default="",
              help="Command that runs dflash-queue [default: this environment's dflash-queue, else python -m].")
@click.option("--user", default="", help="Run the units as this user.")
@click.option("--systemd-version", type=int, default=None,
              help="Target systemd version [default: this machine's]; >= 254 adds RestartSteps back-off.")
@click.option("--force-env", is_flag=True, help="Overwrite an existing environment file (it holds secrets).")
@click.option("--root", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Install under this directory (as DESTDIR): every path it creates is below it; the units name "
              "the installed paths.")
def systemd_install(
    config_path: Path,
    gpus: str | None,
    flower: bool,
    dest: Path,
    env_file: Path | None,
    exec_command: str,
    user: str,
    systemd_version: int | None,
    force_env: bool,
    root: Path | None,
    **lane_groups: str | None,
) -> None:
    """Write the units and their environment file for CONFIG and this node's GPU layout.

    Commas separate workers, a group is a range or GPUs joined by '_': --generate 0-1,2-3 --extract 4,5,6_7 makes
    dflash-generate@0-1 (CUDA_VISIBLE_DEVICES=0,1), dflash-generate@2-3, dflash-extract@4, dflash-extract@5 and
    dflash-extract@6-7.
    """
    from dflash_queue.ops.gpus import parse_gpu_list
    from dflash_queue.ops.systemd import (
        DEFAULT_ENV_FILE,
        InstallSettings,
        UnitLayout,
        detect_systemd_version,
        install_units,
    )

    config = load(config_path)
    node_gpus = None
    if gpus:
        try:
            node_gpus = parse_gpu_list(gpus)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--gpus") from None
    layout = UnitLayout(
        workers={lane: _groups(lane_groups[f"{lane}_groups"], f"--{lane}") for lane in LANES}, flower=flower
    )
    settings = InstallSettings(
        config_path=config_path.resolve(),
        env_file=(env_file or DEFAULT_ENV_FILE).resolve(),
        exec_command=exec_command,
        user=user,
        systemd_version=detect_systemd_version() if systemd_version is None else systemd_version,
    )
    try:
        report = install_units(
            config.run, config.broker, config.storage, layout, settings, dest,
            tensor_parallel=vllm_tensor_parallel(config.generate, config.extract), node_gpus=node_gpus,
            force_env=force_env,
            root=root.resolve() if root else None,
        )
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    except OSError as exc:
        raise click.ClickException(
            f"cannot write the units: {exc} (run as root, or choose --dest/--env-file)"
        ) from None
    for line in report.lines():
        click.echo(line)


@click.command()
@config_option
@click.option("--port", type=click.IntRange(1, 65535), default=None, help="Listen port [default: flower.port].")
@click.option("--address", default=None, help="Listen address [default: flower.address].")
def flower(config_path: Path, port: int | None, address: str | None) -> None:
    """Run Flower for CONFIG's broker; basic auth from FLOWER_BASIC_AUTH (user:password)."""
    from dflash_queue.ops.flower import check_basic_auth, flower_argv, run_flower

    config = broker_ready(load(config_path), "Flower")
    try:
        check_basic_auth(os.environ)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    sys.exit(run_flower(config, flower_argv(config.flower, config.run, port=port, address=address)) or 0)


COMMANDS = [systemd, flower]
