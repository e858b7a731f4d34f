"""The vLLM engines a config runs: vLLM can extract the target exactly (and what the extract engine forces), each
vLLM lane's tensor-parallel group fits in the visible GPUs, and the extract engine's transfer directory can take
the states it hands over."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from dflash_queue.doctor.result import Check
from dflash_queue.engines.config import ExtractVllmConfig
from dflash_queue.engines.vllm.support import (
    DEFAULT_TRANSFER_DIR,
    FORCED_SETTINGS,
    VllmExtractSettings,
    transfer_bytes,
    transfer_room_shortfall,
    vllm_refusal,
)
from dflash_queue.errors import ConfigError

GB = 1000**3


def check_extract_engine(model_config: Any, settings: ExtractVllmConfig) -> Check:
    """Whether vLLM can extract this target's states exactly (`vllm_refusal`), and how the engine will run."""
    refusal = vllm_refusal(model_config)
    if refusal:
        return Check.failed("extract engine", f"vLLM: {refusal}")
    forced = " · ".join(f"{setting} ({why})" for setting, why in FORCED_SETTINGS)
    chunked = (
        "chunked prefill on, every sequence checked whole before it is stored"
        if settings.enable_chunked_prefill
        else "chunked prefill off"
    )
    architecture = ",".join(getattr(model_config, "architectures", None) or [])
    return Check.passed(
        "extract engine",
        f"vLLM extracts {architecture}, tensor parallel {settings.tensor_parallel_size}; forced: {forced}; {chunked}",
    )


def check_tensor_parallel(tensor_parallel: Mapping[str, int], visible_gpus: int) -> list[Check]:
    """Each vLLM lane's engine spans tensor_parallel_size GPUs: at least that many must be visible to a worker
    (CUDA_VISIBLE_DEVICES, which `worker --gpus` sets to its group)."""
    shown = os.environ.get("CUDA_VISIBLE_DEVICES")
    where = f" (CUDA_VISIBLE_DEVICES={shown})" if shown is not None else ""
    checks = []
    for lane, size in tensor_parallel.items():
        name = f"{lane} tensor parallel"
        if visible_gpus >= size:
            checks.append(Check.passed(name, f"{lane}.vllm.tensor_parallel_size {size}: {visible_gpus} GPU(s) visible"))
        elif visible_gpus == 0 and size == 1:
            detail = f"{lane}.vllm.tensor_parallel_size 1: no GPU visible (only vLLM's CPU build runs without one)"
            checks.append(Check.passed(name, detail))
        else:
            checks.append(Check.failed(
                name,
                f"{lane}.vllm.tensor_parallel_size is {size} but {visible_gpus} GPU(s) are visible{where}: the engine "
                "cannot start",
            ))
    return checks


def check_transfer_dir(
    settings: ExtractVllmConfig, text_config: Any, engine_settings: Callable[[], VllmExtractSettings]
) -> Check:
    """The directory the extract engine's processes hand states over in: writable, in memory, with room for
    extract.vllm.inflight_tasks sequences of the engine's whole context (`transfer_room_shortfall`, which the
    worker refuses to start on). `engine_settings` builds what the engine is built from, as a worker does."""
    name = "extract transfer dir"
    configured = settings.transfer_dir
    path = Path(configured) if configured else DEFAULT_TRANSFER_DIR
    existing = next((p for p in (path, *path.parents) if p.is_dir()), None)
    if not configured and (existing != path or not os.access(path, os.W_OK)):
        fallback = Path(tempfile.gettempdir())
        return Check.warned(
            name,
            f"no writable {path}: the engine hands states over through {fallback}, on disk; set "
            "extract.vllm.transfer_dir to a tmpfs directory",
        )
    if existing is None:
        return Check.failed(name, f"{path}: no parent directory exists")
    created = "" if existing == path else f" (created by the engine under {existing})"
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".dfq-doctor-"):
            pass
    except OSError as exc:
        return Check.failed(name, f"{existing} is not writable ({exc.strerror or exc})")
    free = shutil.disk_usage(existing).free
    try:
        setup = engine_settings()
        needed = transfer_bytes(setup, text_config)
        shortfall = transfer_room_shortfall(setup, text_config, existing)
    except (ConfigError, ValueError) as exc:
        return Check.warned(name, f"{path}{created}: {free / GB:,.1f} GB free; cannot size the states ({exc})")
    if shortfall:  # the worker refuses to start on it
        return Check.failed(name, f"{path}{created}: {shortfall}")
    return Check.passed(
        name,
        f"{path}{created}: {free / GB:,.1f} GB free; {settings.inflight_tasks} sequence(s) of "
        f"{setup.context_len:,} tokens need {needed / GB:,.1f} GB",
    )
