"""Every preflight check of `dflash-queue doctor`, one verdict per line.

A failed check means the run would fail or lose data on this node; a warning means it would run, but not as
the operator probably expects.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from dflash_queue.config import Config, GenerateConfig, ModelConfig, RunConfig, StorageConfig
from dflash_queue.doctor.broker import check_broker
from dflash_queue.doctor.disk import check_free_disk
from dflash_queue.doctor.extract_states import check_extract_states
from dflash_queue.doctor.gpu import GpuInfo, check_gpus, read_gpus
from dflash_queue.doctor.model import check_model, check_thinking_template
from dflash_queue.doctor.result import Check
from dflash_queue.doctor.servers import check_servers
from dflash_queue.doctor.speculative import check_speculative
from dflash_queue.doctor.storage import check_configured_storage
from dflash_queue.doctor.versions import check_versions
from dflash_queue.doctor.vllm_engines import check_extract_engine, check_tensor_parallel, check_transfer_dir
from dflash_queue.doctor.workers import check_worker_settings
from dflash_queue.engines.engine_args import speculative_method
from dflash_queue.lanes.config import ExtractConfig
from dflash_queue.lanes.extract import vllm_extract_settings
from dflash_queue.lanes.tensor_parallel import vllm_tensor_parallel

GpuReader = Callable[[], tuple[list[GpuInfo], list[str], str | None]]


def memory_utilization(tensor_parallel: Mapping[str, int], generate: GenerateConfig, extract: ExtractConfig) -> float:
    """The largest gpu_memory_utilization of the lanes on vLLM (`tensor_parallel`'s keys: each reserves it at
    start); with none on vLLM, generate.vllm's."""
    engines = {"generate": generate.vllm, "extract": extract.vllm}
    lanes = list(tensor_parallel) or ["generate"]
    return max(float(engines[lane].gpu_memory_utilization) for lane in lanes)


def writable_dirs(run: RunConfig, storage: StorageConfig, staging_dir: Path) -> dict[str, Path]:
    """`staging_dir`: Config.staging_dir (storage.uploader.staging_dir, or the state directory's staging/)."""
    dirs = {"state": Path(run.state_dir)}
    url = storage.url
    if "://" not in url or url.startswith("file://"):
        dirs["storage"] = Path(url.removeprefix("file://"))
    dirs["staging"] = staging_dir
    return dirs


def run_doctor(
    config: Config,
    *,
    warn_below_gb: float = 20.0,
    fail_below_gb: float = 1.0,
    gpu_reader: GpuReader = read_gpus,
    start_engine: bool = True,
) -> list[Check]:
    """Every check; `start_engine` also starts the vLLM extract engine (extract_states.py)."""
    checks = list(check_broker(config.broker.connection_url()))
    checks += check_configured_storage(config.storage)
    model_checks, tokenizer = check_model(config.model, config.extract)
    checks += model_checks
    if tokenizer is not None:
        checks.append(check_thinking_template(tokenizer, config.dataset.thinking))
    tensor_parallel = vllm_tensor_parallel(config.generate, config.extract)
    checks += check_worker_settings(config)
    checks += check_versions(vllm_needed_by=list(tensor_parallel))
    if config.extract.engine == "vllm":
        checks += _extract_engine_checks(config)
        if start_engine:
            states = check_extract_states(config.extract, config.model, lambda: _start_extract_engine(config))
            if states is not None:
                checks.append(states)
    if speculative_method(config.generate.vllm.engine_args):
        checks += _generate_engine_checks(config.generate, config.model)
    checks += check_servers(config.generate, config.served_model_name, lambda: _build_generate_engine(config))
    gpus, arch_list, torch_cuda = gpu_reader()
    checks += check_gpus(
        gpus,
        arch_list,
        device_setting=config.model.device,
        torch_cuda=torch_cuda,
        memory_utilization=memory_utilization(tensor_parallel, config.generate, config.extract),
        memory_is_required=bool(tensor_parallel),
    )
    checks += check_tensor_parallel(tensor_parallel, len(gpus))
    for label, path in writable_dirs(config.run, config.storage, config.staging_dir).items():
        checks.append(check_free_disk(label, path, warn_below_gb=warn_below_gb, fail_below_gb=fail_below_gb))
    return checks


def _generate_engine_checks(generate: GenerateConfig, model: ModelConfig) -> list[Check]:
    """The generate lane's speculative decoding; none when the model's config does not load."""
    from transformers import AutoConfig

    try:
        model_config = AutoConfig.from_pretrained(model.path)
    except Exception:
        return []
    check = check_speculative(generate, model, model_config)
    return [check] if check else []


def _extract_engine_checks(config: Config) -> list[Check]:
    """The vLLM extract engine's checks; none when the model's config does not load (the model check says so)."""
    from transformers import AutoConfig

    try:
        model_config = AutoConfig.from_pretrained(config.model.path)
    except Exception:
        return []
    return [
        check_extract_engine(model_config, config.extract.vllm),
        check_transfer_dir(config.extract.vllm, model_config.get_text_config(), lambda: vllm_extract_settings(config)),
    ]


def _start_extract_engine(config: Config) -> Any:
    """The vLLM extract engine, started as an extract worker starts it."""
    from dflash_queue.engines.vllm.extract import VllmStateExtractor

    return VllmStateExtractor(vllm_extract_settings(config))


def _build_generate_engine(config: Config) -> Any:
    """The generate lane's engine, built as a generate worker builds it."""
    from dflash_queue.lanes.generate import build_generate_engine

    return build_generate_engine(config)
