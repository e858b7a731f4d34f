"""GPU groups: which GPUs one worker owns, as written in a systemd instance name or on the command line.

A group is GPU indices joined by "-": `0` is GPU 0, `0-1` is GPUs 0 and 1 as one tensor-parallel group,
`4-5-6-7` four GPUs. It is a list, not a range (`0-3` is GPUs 0 and 3), so that any set can be named,
e.g. an NVLink pair `0-2`. "-" rather than "," because systemd unit names cannot hold a comma. The worker
command also accepts commas (`--gpus 0,1`).
"""

from __future__ import annotations

import re

_GROUP = re.compile(r"^\d+([-,]\d+)*$")


def parse_gpu_group(spec: str) -> tuple[int, ...]:
    """`"0-1"` or `"0,1"` -> (0, 1); a clear error for anything else."""
    text = spec.strip()
    if not _GROUP.match(text):
        raise ValueError(
            f"GPU group {spec!r}: expected GPU indices joined by '-' (systemd instance form, e.g. 0 or 0-1) or ','"
        )
    ids = tuple(int(part) for part in re.split(r"[-,]", text))
    if len(set(ids)) != len(ids):
        raise ValueError(f"GPU group {spec!r}: a GPU is listed twice")
    return ids


def instance_name(group: tuple[int, ...]) -> str:
    """The systemd instance name of a group: (0, 1) -> "0-1"."""
    return "-".join(str(gpu) for gpu in group)


def visible_devices(group: tuple[int, ...]) -> str:
    """CUDA_VISIBLE_DEVICES for a group: (0, 1) -> "0,1"."""
    return ",".join(str(gpu) for gpu in group)


def parse_gpu_groups(spec: str) -> tuple[tuple[int, ...], ...]:
    """Several workers' groups: comma-separated groups, each in instance form ("0-1,2-3" -> two workers)."""
    groups = []
    for part in spec.split(","):
        if not part.strip():
            raise ValueError(f"GPU groups {spec!r}: empty group")
        if "," in part or not re.fullmatch(r"\d+(-\d+)*", part.strip()):
            raise ValueError(f"GPU groups {spec!r}: {part!r} is not a group like 0 or 0-1")
        groups.append(parse_gpu_group(part))
    return tuple(groups)


def parse_gpu_list(spec: str) -> tuple[int, ...]:
    """The GPUs of a node: a count ("8" -> 0..7) or a list ("0,1,2,3")."""
    text = spec.strip()
    if text.isdigit() and "," not in text:
        return tuple(range(int(text)))
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(
            f"GPUs {spec!r}: expected a count (8) or a comma-separated list of indices (0,1,2,3)"
        ) from None
