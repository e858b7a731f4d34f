"""`dflash-queue doctor`: preflight checks of a node against its config, one verdict per line.

A failed check means the run would fail or lose data on this node; a warning means it would run, but not as
the operator probably expects.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from dflash_queue.config import Config
from dflash_queue.doctor.broker import check_broker
from dflash_queue.doctor.disk import check_free_disk
from dflash_queue.doctor.gpu import GpuInfo, check_gpus, read_gpus
from dflash_queue.doctor.model import check_model, check_thinking_template
from dflash_queue.doctor.result import Check
from dflash_queue.doctor.storage import check_configured_storage
from dflash_queue.doctor.versions import check_versions

DEFAULT_MEMORY_UTILIZATION = 0.9

GpuReader = Callable[[], tuple[list[GpuInfo], list[str], str | None]]


def memory_utilization(config: Config) -> float:
    """generate.vllm.gpu_memory_utilization when the config has that section, else vLLM's default."""
    engine_settings = getattr(config.generate, "vllm", None)
    value = getattr(engine_settings, "gpu_memory_utilization", None)
    return float(value) if value else DEFAULT_MEMORY_UTILIZATION


def writable_dirs(config: Config) -> dict[str, Path]:
    dirs = {"state": Path(config.run.state_dir)}
    url = config.storage.url
    if "://" not in url or url.startswith("file://"):
        dirs["storage"] = Path(url.removeprefix("file://"))
    staging = getattr(config.storage, "staging_dir", "")
    if staging:
        dirs["staging"] = Path(staging)
    return dirs


def run_doctor(
    config: Config,
    *,
    warn_below_gb: float = 20.0,
    fail_below_gb: float = 1.0,
    gpu_reader: GpuReader = read_gpus,
) -> list[Check]:
    checks = list(check_broker(config.broker.url))
    checks += check_configured_storage(config.storage)
    model_checks, tokenizer = check_model(config)
    checks += model_checks
    if tokenizer is not None:
        checks.append(check_thinking_template(tokenizer, config.dataset.thinking))
    uses_vllm = config.generate.engine == "vllm"
    checks += check_versions(vllm_needed=uses_vllm)
    gpus, arch_list, torch_cuda = gpu_reader()
    checks += check_gpus(
        gpus,
        arch_list,
        device_setting=config.model.device,
        torch_cuda=torch_cuda,
        memory_utilization=memory_utilization(config),
        memory_is_required=uses_vllm,
    )
    for label, path in writable_dirs(config).items():
        checks.append(check_free_disk(label, path, warn_below_gb=warn_below_gb, fail_below_gb=fail_below_gb))
    return checks


__all__ = ["Check", "GpuInfo", "run_doctor"]
