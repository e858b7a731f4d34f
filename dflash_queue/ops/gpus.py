"""GPU groups: which GPUs one worker owns, as written on the command line or in a systemd instance name, and how
many GPUs this node has.

A group is made of ranges and single GPUs: `0` is GPU 0, `0-3` GPUs 0 to 3 (one tensor-parallel group of four),
`0,2` GPUs 0 and 2, `0-1,4-5` four GPUs. systemd unit names cannot hold a comma, so an instance name joins the
parts with "_" (`dflash-extract@0_2`, `dflash-extract@0-3`), which `worker --gpus` takes as well. Where several
workers' groups are listed (`systemd install --extract 0-3,4-7`: two workers), commas separate the groups and a
group of several parts is written with "_".
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

_PART = re.compile(r"^(\d+)(?:-(\d+))?$")
NVIDIA_PROC = Path("/proc/driver/nvidia/gpus")


def _parse_parts(spec: str, parts: list[str], what: str) -> tuple[int, ...]:
    ids: list[int] = []
    for part in parts:
        match = _PART.match(part.strip())
        if not match:
            hint = ""
            if re.fullmatch(r"\d+(-\d+){2,}", part.strip()):
                numbers = part.strip().split("-")
                hint = (
                    f"; a range is FIRST-LAST: {numbers[0]}-{numbers[-1]} is GPUs {numbers[0]} to {numbers[-1]}, "
                    f"{','.join(numbers)} lists them"
                )
            raise ValueError(
                f"{what} {spec!r}: {part!r} is neither a GPU index (0) nor a range (0-3){hint}"
            )
        first, last = int(match.group(1)), match.group(2)
        if last is None:
            ids.append(first)
            continue
        if int(last) <= first:
            raise ValueError(f"{what} {spec!r}: the range {part!r} does not go up (write FIRST-LAST, e.g. 0-3)")
        ids.extend(range(first, int(last) + 1))
    if len(set(ids)) != len(ids):
        raise ValueError(f"{what} {spec!r}: a GPU is listed twice")
    return tuple(ids)


def parse_gpu_group(spec: str) -> tuple[int, ...]:
    """One worker's GPUs: `"0-3"` -> (0, 1, 2, 3), `"0,2"` or `"0_2"` -> (0, 2); a clear error for anything else."""
    text = spec.strip()
    if not text:
        raise ValueError("GPU group '': expected GPU indices and ranges, e.g. 0, 0-3 or 0,2")
    return _parse_parts(spec, re.split(r"[,_]", text), "GPU group")


def instance_name(group: tuple[int, ...]) -> str:
    """The systemd instance name of a group, which `parse_gpu_group` reads back: (0, 1, 2, 3) -> "0-3",
    (0, 2) -> "0_2", (0, 1, 4, 5) -> "0-1_4-5"."""
    runs: list[list[int]] = []
    for gpu in group:
        if runs and gpu == runs[-1][-1] + 1:
            runs[-1].append(gpu)
        else:
            runs.append([gpu])
    return "_".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)


def visible_devices(group: tuple[int, ...]) -> str:
    """CUDA_VISIBLE_DEVICES for a group: (0, 1) -> "0,1"."""
    return ",".join(str(gpu) for gpu in group)


def parse_gpu_groups(spec: str) -> tuple[tuple[int, ...], ...]:
    """Several workers' groups, separated by commas, each in instance form ("0-1,2-3" -> two workers of two GPUs,
    "0_2,1_3" -> two workers of GPUs 0 and 2, 1 and 3)."""
    groups = []
    for part in spec.split(","):
        if not part.strip():
            raise ValueError(f"GPU groups {spec!r}: empty group")
        groups.append(_parse_parts(spec, part.strip().split("_"), "GPU groups"))
    return tuple(groups)


def parse_gpu_list(spec: str) -> tuple[int, ...]:
    """The GPUs of a node: a count ("8" -> 0..7) or indices and ranges ("0,1,2,3", "0-3")."""
    text = spec.strip()
    if text.isdigit():
        return tuple(range(int(text)))
    try:
        return _parse_parts(spec, text.split(","), "GPUs")
    except ValueError as exc:
        raise ValueError(f"{exc}; expected a count (8) or a comma-separated list of indices (0,1,2,3)") from None


@dataclass(frozen=True)
class NodeGpus:
    """How many GPUs this node has, and who said so."""

    count: int
    source: str


def node_gpus() -> NodeGpus:
    """This node's GPUs, all of them whatever CUDA_VISIBLE_DEVICES says: nvidia-smi's list, else the NVIDIA
    driver's /proc entries, else torch.cuda.device_count() in a child process (so that CUDA is not initialised
    in this one before CUDA_VISIBLE_DEVICES is set)."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            listed = subprocess.run(
                [smi, "--query-gpu=index", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
            )
        except (OSError, subprocess.TimeoutExpired):
            listed = None
        if listed is not None and listed.returncode == 0:
            return NodeGpus(sum(1 for line in listed.stdout.splitlines() if line.strip()), "nvidia-smi")
    if NVIDIA_PROC.is_dir():
        return NodeGpus(sum(1 for _ in NVIDIA_PROC.iterdir()), str(NVIDIA_PROC))
    env = {name: value for name, value in os.environ.items() if name not in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")}
    try:
        counted = subprocess.run(
            [sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
            capture_output=True, text=True, timeout=120, env=env,
        )
        count = int(counted.stdout.strip().splitlines()[-1]) if counted.returncode == 0 else 0
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        count = 0
    return NodeGpus(count, "torch.cuda.device_count()")


def missing_gpus_error(group: tuple[int, ...], node: NodeGpus) -> str | None:
    """Why `group` cannot run on a node with `node` GPUs (None: it can)."""
    if node.count == 0:
        return (
            f"this node has no GPU ({node.source} finds none): a CPU node runs its engines without --gpus"
        )
    missing = [gpu for gpu in group if gpu >= node.count]
    if not missing:
        return None
    have = "GPU 0" if node.count == 1 else f"GPUs 0-{node.count - 1}"
    return (
        f"GPU {', '.join(map(str, missing))} not on this node: it has {node.count} ({have}, from {node.source})"
    )
