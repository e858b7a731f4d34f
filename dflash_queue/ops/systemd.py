"""systemd units for a node: one worker unit instance per GPU group and lane, Flower, and a target for all.

The templates live in `dflash_queue/ops/units/` (`systemd/` in the repository points there); `render_units`
fills in the paths, timeouts and back-off for a config and a GPU layout, and `install_units` writes them with
the environment file that carries the broker/storage URLs and secrets.
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from dflash_queue.config import (
    BROKER_URL_ENV,
    PASSWORD_ENV,
    PASSWORD_FILE_ENV,
    STORAGE_URL_ENV,
    BrokerConfig,
    RunConfig,
    StorageConfig,
)
from dflash_queue.lanes.registry import LANES
from dflash_queue.lanes.tensor_parallel import group_size_error
from dflash_queue.ops.gpus import instance_name
from dflash_queue.queue.config import SENTINEL_PASSWORD_ENV, SENTINEL_PASSWORD_FILE_ENV
from dflash_queue.runstate.stopped_workers import EXIT_FAILING_CHECKS

FLOWER_UNIT = "dflash-flower.service"
TARGET_UNIT = "dflash.target"
DEFAULT_ENV_FILE = Path("/etc/dflash-queue/dflash.env")
DEFAULT_DEST = Path("/etc/systemd/system")
# Warm shutdown lets the running task finish: stop waits this much longer than the longest task.
STOP_MARGIN_S = 120
RESTART_S = 30
# systemd >= 254 grows RestartSec in steps up to this, so a node with a broken GPU does not spin.
RESTART_MAX_DELAY_S = 600
RESTART_STEPS = 5
START_LIMIT_BURST = 10
START_LIMIT_INTERVAL_S = 3600
BACKOFF_MIN_SYSTEMD = 254

GpuGroup = tuple[int, ...]


# Every lane's worker unit is rendered from this one template, its @LANE@ filled in.
WORKER_TEMPLATE = "dflash-lane@.service"


def worker_unit(lane: str) -> str:
    """The template unit of a lane's workers, as installed."""
    return f"dflash-{lane}@.service"


@dataclass(frozen=True)
class UnitLayout:
    """Which GPU groups run a worker of which lane on this node: lane name -> GPU groups."""

    workers: dict[str, tuple[GpuGroup, ...]] = field(default_factory=dict)
    flower: bool = True

    def lanes(self) -> list[str]:
        """Lanes with workers here, in pipeline order."""
        return [lane for lane in LANES if self.workers.get(lane)]

    def instances(self) -> list[str]:
        units = [
            worker_unit(lane).replace("@", f"@{instance_name(group)}")
            for lane in self.lanes()
            for group in self.workers[lane]
        ]
        if self.flower:
            units.append(FLOWER_UNIT)
        return units

    def check(
        self, node_gpus: tuple[int, ...] | None = None, tensor_parallel: Mapping[str, int] | None = None
    ) -> list[str]:
        """Errors raise; returns warnings (a GPU shared by workers of several lanes). `tensor_parallel`: the lanes
        on vLLM and their tensor_parallel_size, which every group of theirs must have (a group of the
        Transformers extract engine may have any size: it spreads its layers over the group)."""
        unknown = sorted(set(self.workers) - set(LANES))
        if unknown:
            raise ValueError(f"unknown lane(s) {unknown}; lanes are {list(LANES)}")
        if not self.lanes():
            raise ValueError("no workers: give " + " and/or ".join(f"--{lane}" for lane in LANES) + " GPU groups")
        warnings = []
        users: dict[int, list[str]] = {}
        sizes = tensor_parallel or {}
        for lane in self.lanes():
            seen: dict[int, GpuGroup] = {}
            for group in self.workers[lane]:
                size_error = group_size_error(lane, group, sizes[lane]) if lane in sizes else None
                if size_error:
                    raise ValueError(f"--{lane}: {size_error}")
                for gpu in group:
                    if gpu in seen:
                        raise ValueError(
                            f"--{lane}: GPU {gpu} is in two {lane} groups ({instance_name(seen[gpu])} and "
                            f"{instance_name(group)}); each would load a full engine on it"
                        )
                    seen[gpu] = group
                    if node_gpus is not None and gpu not in node_gpus:
                        raise ValueError(f"--{lane}: GPU {gpu} is not one of this node's GPUs {list(node_gpus)}")
            for gpu in seen:
                users.setdefault(gpu, []).append(lane)
        shared = sorted(gpu for gpu, lanes in users.items() if len(lanes) > 1)
        if shared:
            lanes = sorted({lane for gpu in shared for lane in users[gpu]}, key=list(LANES).index)
            warnings.append(
                f"GPUs {shared} run workers of several lanes ({', '.join(lanes)}): every engine must fit in memory"
            )
        return warnings


@dataclass(frozen=True)
class InstallSettings:
    config_path: Path
    env_file: Path = DEFAULT_ENV_FILE
    exec_command: str = ""
    working_directory: Path | None = None
    user: str = ""
    systemd_version: int = 0
    extra_environment: dict[str, str] = field(default_factory=dict)


def default_exec_command() -> tuple[str, dict[str, str]]:
    """This environment's `dflash-queue` script, else `python -m dflash_queue` with the package on PYTHONPATH."""
    script = Path(sys.executable).parent / "dflash-queue"
    if script.is_file() and os.access(script, os.X_OK):
        return str(script), {}
    package_parent = Path(__file__).resolve().parents[2]
    return f"{sys.executable} -m dflash_queue", {"PYTHONPATH": str(package_parent)}


def detect_systemd_version() -> int:
    """The running systemd's version (0 if unknown), which decides whether back-off keys exist."""
    try:
        out = subprocess.run(["systemctl", "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    match = re.match(r"systemd (\d+)", out)
    return int(match.group(1)) if match else 0


def template(name: str) -> str:
    return resources.files("dflash_queue.ops").joinpath("units", name).read_text(encoding="utf-8")


def render_units(run: RunConfig, broker: BrokerConfig, layout: UnitLayout, settings: InstallSettings) -> dict[str, str]:
    """File name -> contents of every unit this layout needs."""
    exec_command = settings.exec_command
    default_env: dict[str, str] = {}
    if not exec_command:
        exec_command, default_env = default_exec_command()
    environment = {**default_env, **settings.extra_environment}
    backoff = ""
    if settings.systemd_version >= BACKOFF_MIN_SYSTEMD:
        backoff = f"RestartSteps={RESTART_STEPS}\nRestartMaxDelaySec={RESTART_MAX_DELAY_S}"
    fields = {
        "ENV_FILE": str(settings.env_file),
        "EXTRA_ENVIRONMENT": "\n".join(f"Environment={_quote(f'{k}={v}')}" for k, v in environment.items()),
        "WORKING_DIRECTORY": str(settings.working_directory or Path(run.state_dir)),
        "USER": f"User={settings.user}" if settings.user else "",
        "EXEC": exec_command,
        "CONFIG": str(settings.config_path.resolve()),
        "TIMEOUT_STOP_S": str(broker.task_timeout_s + STOP_MARGIN_S),
        "RESTART_S": str(RESTART_S),
        "FAILING_CHECKS_EXIT_STATUS": str(EXIT_FAILING_CHECKS),
        "RESTART_BACKOFF": backoff,
        "START_LIMIT_BURST": str(START_LIMIT_BURST),
        "START_LIMIT_INTERVAL_S": str(START_LIMIT_INTERVAL_S),
        "WANTS": " ".join(layout.instances()),
    }
    units = {TARGET_UNIT: _fill(template(TARGET_UNIT), fields)}
    for lane in layout.lanes():
        units[worker_unit(lane)] = _fill(template(WORKER_TEMPLATE), {**fields, "LANE": lane})
    if layout.flower:
        units[FLOWER_UNIT] = _fill(template(FLOWER_UNIT), fields)
    return units


def _fill(text: str, fields: dict[str, str]) -> str:
    lines = []
    for line in text.splitlines():
        whole = re.fullmatch(r"@([A-Z_]+)@", line.strip())
        if whole and not fields[whole.group(1)]:
            continue  # an optional line with nothing to say
        lines.append(re.sub(r"@([A-Z_]+)@", lambda m: fields[m.group(1)], line))
    left = [m for line in lines if not line.startswith("#") for m in re.findall(r"@([A-Z_]+)@", line)]
    if left:
        raise KeyError(f"unfilled template fields: {left}")
    return "\n".join(lines) + "\n"


def _quote(assignment: str) -> str:
    return f'"{assignment}"' if any(c.isspace() for c in assignment) else assignment


def env_file_text(broker: BrokerConfig, storage: StorageConfig, *, flower_password: str | None = None) -> str:
    password = flower_password or secrets.token_urlsafe(18)
    broker_url = broker.url or "redis://BROKER-HOST:6379/0"
    return "\n".join(
        [
            "# Environment of the dflash-queue units (EnvironmentFile=). Mode 0600: it holds secrets.",
            f"# {BROKER_URL_ENV} and {STORAGE_URL_ENV} override broker.url and storage.url of the config.",
            f"{BROKER_URL_ENV}={broker_url}",
            f"{STORAGE_URL_ENV}={storage.url}",
            "# The broker's password (never in the config or the URL), or a file holding it; the user is",
            "# broker.username. Leave them commented out for a broker without a password (loopback only).",
            f"#{PASSWORD_ENV}=",
            f"#{PASSWORD_FILE_ENV}=/etc/dflash-queue/broker.password",
            "# With Redis Sentinel (a sentinel:// broker.url and broker.sentinel_master): the sentinels' own",
            "# password, or a file holding it, when they have one (the primary's is the broker's, above).",
            f"#{SENTINEL_PASSWORD_ENV}=",
            f"#{SENTINEL_PASSWORD_FILE_ENV}=/etc/dflash-queue/sentinel.password",
            "# S3 credentials for s3:// storage; leave them commented out to use an instance role.",
            "#AWS_ACCESS_KEY_ID=",
            "#AWS_SECRET_ACCESS_KEY=",
            "#AWS_DEFAULT_REGION=",
            "#AWS_ENDPOINT_URL=",
            "# Flower basic auth, user:password (comma-separate several users).",
            f"FLOWER_BASIC_AUTH=admin:{password}",
            "# Models are local paths: never reach a model hub from a worker.",
            "HF_HUB_OFFLINE=1",
            "",
        ]
    )


@dataclass
class InstallReport:
    created: list[Path] = field(default_factory=list)  # directories that did not exist
    written: list[Path] = field(default_factory=list)
    env_file: Path | None = None
    env_file_kept: bool = False
    warnings: list[str] = field(default_factory=list)
    instances: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        out = [f"created directory {path}" for path in self.created]
        out += [f"wrote {path}" for path in self.written]
        if self.env_file is not None:
            out.append(f"{'kept existing' if self.env_file_kept else 'wrote'} {self.env_file} (mode 0600)")
        out.extend(f"warning: {w}" for w in self.warnings)
        out.append("next: systemctl daemon-reload && systemctl enable --now dflash.target")
        out.append(f"units: {' '.join(self.instances)}")
        return out


def install_units(
    run: RunConfig,
    broker: BrokerConfig,
    storage: StorageConfig,
    layout: UnitLayout,
    settings: InstallSettings,
    dest: Path,
    *,
    tensor_parallel: Mapping[str, int],
    node_gpus: tuple[int, ...] | None = None,
    force_env: bool = False,
    root: Path | None = None,
) -> InstallReport:
    """Write the units into `dest` and the environment file (kept if it exists, unless `force_env`), and create
    the units' working directory. `tensor_parallel`: each vLLM lane's group size (lanes/tensor_parallel.py), checked
    against the layout. With `root` (as DESTDIR for `make install`), every path is created under it
    (the units still name the paths of the installed system), and nothing outside it is touched."""
    warnings = layout.check(node_gpus, tensor_parallel)
    report = InstallReport(warnings=warnings, instances=layout.instances())

    def under_root(path: Path) -> Path:
        path = path.absolute()
        return root / path.relative_to(path.anchor) if root is not None else path

    def make_dir(path: Path) -> None:
        missing = [p for p in (path, *path.parents) if not p.exists()]
        path.mkdir(parents=True, exist_ok=True)
        report.created.extend(reversed(missing))

    dest = under_root(dest)
    make_dir(dest)
    # systemd refuses to start a unit whose WorkingDirectory does not exist.
    make_dir(under_root(Path(settings.working_directory or run.state_dir)))
    for name, text in render_units(run, broker, layout, settings).items():
        path = dest / name
        path.write_text(text, encoding="utf-8")
        report.written.append(path)
    env_file = under_root(settings.env_file)
    report.env_file = env_file
    if env_file.exists() and not force_env:
        report.env_file_kept = True
    else:
        make_dir(env_file.parent)
        fd = os.open(env_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(env_file_text(broker, storage))
        os.chmod(env_file, 0o600)
    return report
