"""vLLM on a CPU device (its CPU build): two settings the worker chooses itself, because vLLM's own defaults do not
start there.

* The KV cache. Without `kv_cache_memory_gib` (or `VLLM_CPU_KVCACHE_SPACE`) vLLM's CPU worker reserves
  `gpu_memory_utilization` (0.9) of the host's memory and refuses to start when that much is not free, which on a
  shared machine it never is ("Engine core initialization failed" after a minute). The worker sizes it instead: the
  sequences it keeps in flight at the engine's max_model_len, at the cache one token takes (keys and values of
  every attention layer on one rank, plus the extract engine's hidden-state cache), bounded by a share of the
  memory free now. A single sequence that does not fit that bound is refused at start, naming the setting.
* The cores of tensor-parallel ranks. vLLM's default binding ("auto") gives each rank a NUMA node of its own and
  refuses ("Not enough allowed NUMA nodes") where there are fewer nodes than ranks, as on most single-socket
  machines. There the worker splits the cores this process may use (os.sched_getaffinity) into one range per rank
  (`VLLM_CPU_OMP_THREADS_BIND="0-6|7-13"`), leaving one core per rank to vLLM's engine process when each rank
  still gets two; a binding the user set (the environment or LANE.vllm.env) is kept.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

from dflash_queue.engines.cache_shapes import kv_cache_bytes_per_token
from dflash_queue.engines.config import ExtractVllmConfig, VllmEngineSettings
from dflash_queue.engines.devices import GPU_DTYPE_BYTES
from dflash_queue.errors import ConfigError

log = logging.getLogger(__name__)

THREADS_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
KV_CACHE_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"
# The share of the memory free at start the KV cache may take by default: the weights, the activations, the states
# in flight and the other lane's engine on the same box need the rest.
CACHE_SHARE_OF_FREE = 0.25
# Room over the tokens' own bytes: vLLM rounds every sequence up to whole blocks and lays groups out in pages.
CACHE_HEADROOM = 1.25
CACHE_FLOOR_BYTES = 64 * 2**20
GIB = 2**30


def lane_of(settings: VllmEngineSettings) -> str:
    """The config section `settings` is (`generate.vllm` or `extract.vllm`), for messages naming a key."""
    return "extract" if isinstance(settings, ExtractVllmConfig) else "generate"


def on_cpu() -> bool:
    """Whether the installed vLLM runs on the CPU (its CPU build)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


# ---------------------------------------------------------------------------------------------------------------
# Cores of tensor-parallel ranks


def threads_bind(cores: Sequence[int], ranks: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `ranks` ranks over `cores`: contiguous shares of the sorted cores, one per
    rank, "|"-separated ("0|1", "0-6|7-13"); when every rank still gets two cores, one core per rank is left out for
    vLLM's engine process. Raises ValueError for fewer cores than ranks."""
    ordered = sorted(cores)
    if len(ordered) < ranks:
        raise ValueError(f"{len(ordered)} core(s) for {ranks} ranks")
    usable = len(ordered) - ranks if len(ordered) - ranks >= 2 * ranks else len(ordered)
    share = usable // ranks
    parts = []
    for rank in range(ranks):
        mine = ordered[rank * share : (rank + 1) * share]
        parts.append(",".join(_ranges(mine)))
    return "|".join(parts)


def _ranges(cores: Sequence[int]) -> list[str]:
    runs: list[list[int]] = []
    for core in cores:
        if runs and core == runs[-1][-1] + 1:
            runs[-1].append(core)
        else:
            runs.append([core])
    return [str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs]


def bind_rank_threads(settings: VllmEngineSettings) -> None:
    """On a CPU device with tensor_parallel_size > 1 and fewer NUMA nodes than ranks, set VLLM_CPU_OMP_THREADS_BIND
    (unless it is set) to one core range per rank; refuse with the fix when there are fewer cores than ranks."""
    ranks = settings.tensor_parallel_size
    if ranks <= 1 or os.environ.get(THREADS_BIND_ENV) or not on_cpu():
        return
    from vllm.utils.cpu_resource_utils import get_visible_memory_node

    if len(get_visible_memory_node()) >= ranks:
        return  # vLLM's own binding gives each rank a NUMA node
    lane = lane_of(settings)
    cores = sorted(os.sched_getaffinity(0))
    try:
        binding = threads_bind(cores, ranks)
    except ValueError:
        raise ConfigError(
            f"{lane}.vllm.tensor_parallel_size is {ranks} but this process may use {len(cores)} CPU core(s) "
            f"(os.sched_getaffinity): vLLM's CPU build needs a core per rank; lower {lane}.vllm.tensor_parallel_size "
            f"or set {THREADS_BIND_ENV} (e.g. in {lane}.vllm.env) to one core list per rank, '|'-separated"
        ) from None
    os.environ[THREADS_BIND_ENV] = binding
    log.info(
        "vLLM %s engine on the CPU, tensor parallel %d: %s=%s (one core range per rank from cores %s; set it in "
        "%s.vllm.env to choose)", lane, ranks, THREADS_BIND_ENV, binding, ",".join(_ranges(cores)), lane,
    )


# ---------------------------------------------------------------------------------------------------------------
# The KV cache


def _dtype_bytes(name: Any, text_config: Any) -> int:
    name = str(name or "auto").removeprefix("torch.")
    if name in ("", "auto"):
        name = str(getattr(text_config, "dtype", None) or getattr(text_config, "torch_dtype", None) or "bfloat16")
        name = name.removeprefix("torch.")
    if name.startswith("fp8"):
        return 1
    return GPU_DTYPE_BYTES.get(name, 2)


def cache_bytes_per_token(engine_args: Mapping[str, Any], text_config: Any) -> int:
    """The cache one token takes on one rank of the engine `engine_args` describe: keys and values of every
    attention layer, and the residual stream of every aux layer when it runs vLLM's extract_hidden_states (whole
    on every rank)."""
    ranks = int(engine_args.get("tensor_parallel_size") or 1)
    dtype = _dtype_bytes(engine_args.get("dtype"), text_config)
    kv_dtype = engine_args.get("kv_cache_dtype") or "auto"
    per_token = kv_cache_bytes_per_token(text_config, dtype if kv_dtype == "auto" else _dtype_bytes(kv_dtype, text_config), ranks)
    speculative = engine_args.get("speculative_config") or {}
    if isinstance(speculative, Mapping) and speculative.get("method") == "extract_hidden_states":
        aux = speculative["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"]
        per_token += len(aux) * int(text_config.hidden_size) * dtype
    return per_token


def cpu_kv_cache_bytes(
    per_token: int, *, max_model_len: int, sequences: int, ranks: int, free_bytes: int
) -> tuple[int, str | None]:
    """(KV cache bytes per rank, None), or (0, why not) when one sequence of max_model_len does not fit in
    CACHE_SHARE_OF_FREE of `free_bytes` over `ranks` ranks."""
    bound = int(free_bytes * CACHE_SHARE_OF_FREE / ranks)
    one = int(max_model_len * per_token * CACHE_HEADROOM)
    if one > bound:
        return 0, (
            f"one sequence of max_model_len ({max_model_len:,} tokens) needs {one * ranks / GIB:,.2f} GiB of KV "
            f"cache, more than {CACHE_SHARE_OF_FREE:.0%} of the memory free now ({free_bytes / GIB:,.1f} GiB)"
        )
    wanted = max(CACHE_FLOOR_BYTES, int(sequences * max_model_len * per_token * CACHE_HEADROOM))
    return min(wanted, bound), None


def size_cpu_kv_cache(engine_args: dict[str, Any], settings: VllmEngineSettings, *, in_flight: int = 0) -> None:
    """On a CPU device with no cache size set (kv_cache_memory_gib, VLLM_CPU_KVCACHE_SPACE), set
    `kv_cache_memory_bytes` in `engine_args`: `in_flight` sequences (default max_num_seqs) of the engine's
    max_model_len, within CACHE_SHARE_OF_FREE of the free memory; refuse with the one-line fix otherwise."""
    if "kv_cache_memory_bytes" in engine_args or os.environ.get(KV_CACHE_SPACE_ENV) or not on_cpu():
        return
    import psutil

    from dflash_queue.engines.decoder import read_layout

    lane = lane_of(settings)
    text = read_layout(str(engine_args["model"])).text_config
    max_model_len = int(engine_args.get("max_model_len") or getattr(text, "max_position_embeddings", 0) or 0)
    ranks = int(engine_args.get("tensor_parallel_size") or 1)
    sequences = max(1, min(in_flight or settings.max_num_seqs, settings.max_num_seqs))
    per_token = cache_bytes_per_token(engine_args, text)
    free = int(psutil.virtual_memory().available)
    size, refusal = cpu_kv_cache_bytes(
        per_token, max_model_len=max_model_len, sequences=sequences, ranks=ranks, free_bytes=free
    )
    if refusal:
        raise ConfigError(
            f"vLLM {lane} engine on the CPU: {refusal}: set {lane}.vllm.kv_cache_memory_gib (or "
            f"{KV_CACHE_SPACE_ENV}), or lower {lane}.vllm.max_model_len"
        )
    engine_args["kv_cache_memory_bytes"] = size
    log.info(
        "vLLM %s engine on the CPU: KV cache %.2f GiB per rank for %d sequence(s) of %d tokens (%d bytes a token; "
        "vLLM would reserve %d%% of the host's memory; set %s.vllm.kv_cache_memory_gib to choose)",
        lane, size / GIB, sequences, max_model_len, per_token, round(100 * settings.gpu_memory_utilization), lane,
    )
