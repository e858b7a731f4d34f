"""A node's GPU listing where this machine has none: an `nvidia-smi` that lists `count` GPUs, as the worker's
`--gpus` check reads it (`dflash_queue.ops.gpus.node_gpus`). Put its directory first on PATH."""

from __future__ import annotations

import stat
from pathlib import Path


def fake_nvidia_smi(directory: Path, count: int) -> Path:
    """Write `directory/nvidia-smi` answering `--query-gpu=index` with GPUs 0..count-1; returns `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    script = directory / "nvidia-smi"
    script.write_text("#!/bin/sh\n" + "".join(f"echo {i}\n" for i in range(count)))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return directory
