"""Which lanes run a vLLM engine and over how many GPUs: the size every GPU group of such a lane must have.

A lane's engine settings are the config section named after the lane (`[generate]`, `[extract]`): its `engine`,
and for vLLM its `vllm.tensor_parallel_size`. A vLLM engine spans exactly that many GPUs, so a worker's group of
another size either leaves GPUs idle or cannot start. The Transformers extract engine takes a group of any size
(it spreads its layers over the group's GPUs).
"""

from __future__ import annotations

from collections.abc import Sequence

from dflash_queue.config import Config
from dflash_queue.lanes.registry import LANES


def vllm_tensor_parallel(config: Config) -> dict[str, int]:
    """Lane -> tensor_parallel_size, for the lanes whose engine is vLLM, in pipeline order."""
    sizes = {}
    for lane in LANES:
        section = getattr(config, lane, None)
        if section is not None and getattr(section, "engine", None) == "vllm":
            sizes[lane] = int(section.vllm.tensor_parallel_size)
    return sizes


def group_size_error(lane: str, group: Sequence[int], tensor_parallel_size: int) -> str | None:
    """Why a worker of `lane` cannot run on `group` (None: it can)."""
    if len(group) == tensor_parallel_size:
        return None
    listed = ",".join(str(gpu) for gpu in group)
    example = "0" if tensor_parallel_size == 1 else f"0-{tensor_parallel_size - 1}"
    return (
        f"{lane} GPU group {listed} has {len(group)} GPU(s) but {lane}.vllm.tensor_parallel_size is "
        f"{tensor_parallel_size}: a vLLM engine spans exactly tensor_parallel_size GPUs; give groups of "
        f"{tensor_parallel_size} (e.g. {example}) or change the setting"
    )
