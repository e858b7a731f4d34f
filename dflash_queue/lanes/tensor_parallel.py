"""Which lanes run a vLLM engine and over how many GPUs: the size every GPU group of such a lane must have.

A lane's engine settings are the config section named after the lane (`[generate]`, `[extract]`): its `engine`,
and for vLLM its `vllm.tensor_parallel_size`. A vLLM engine spans exactly that many GPUs, so a worker's group of
another size either leaves GPUs idle or cannot start. The Transformers extract engine takes a group of any size
(it spreads its layers over the group's GPUs).
"""

from __future__ import annotations

from collections.abc import Sequence

from dflash_queue.engines.config import ExtractEngineSettings, GenerateConfig
from dflash_queue.lanes.registry import LANES


def vllm_tensor_parallel(generate: GenerateConfig, extract: ExtractEngineSettings) -> dict[str, int]:
    """Lane -> tensor_parallel_size, for the lanes whose engine is vLLM, in pipeline order; each lane's section
    is handed in by its name."""
    sections: dict[str, GenerateConfig | ExtractEngineSettings] = {"generate": generate, "extract": extract}
    return {
        lane: int(sections[lane].vllm.tensor_parallel_size)
        for lane in LANES
        if lane in sections and sections[lane].engine == "vllm"
    }


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
