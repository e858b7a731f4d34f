"""What one extract worker holds on each of its GPUs, and the prefill rate `plan` assumes for it when none is
given.

vLLM engine (tensor parallel over T GPUs): each GPU holds 1/T of the weights, then fills its share of
`gpu_memory_utilization` (or `kv_cache_memory_gib`) with cache: per token in flight, its keys and values at the
attention layers (its share of the key/value heads; fewer heads than GPUs are replicated) and the hidden-state
cache group of `extract_hidden_states` (every aux layer's state, whole on every GPU). vLLM's own activation peak
and CUDA graphs (a few GiB) come out of the same budget and are not counted here.

Transformers engine over a group of G GPUs: the decoder it loads (no LM head, no layer above the highest one
captured) split over the G GPUs, plus one pass's activations (`pass_activation_bytes` at extract.token_budget),
counted on every GPU (the capture buffers sit on the first; each GPU runs its layers on the whole pass).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from dflash_queue.engines.activation_memory import pass_activation_bytes
from dflash_queue.engines.config import ModelConfig
from dflash_queue.engines.devices import GPU_DTYPE_BYTES
from dflash_queue.engines.layers import resolve_layer_ids, vllm_aux_layer_ids
from dflash_queue.lanes.config import ExtractConfig
from dflash_queue.ops import humanize
from dflash_queue.ops.model_size import (
    ParameterCount,
    checkpoint_total_size,
    count_parameters,
    kv_cache_bytes_per_token,
)

GIB = 1024**3
# An H200 SXM as nvidia-smi reports it: 143,771 MiB (NVIDIA's "141 GB"), 140.4 GiB.
H200_MEMORY_GIB = 143_771 / 1024
# bf16 matrix products on an H200, as measured (an 8192^3 product: ~790 TFLOP/s; NVIDIA's dense datasheet figure
# is 989), the same reference tools/bench_extract_gpu.py gives its MFU against.
H200_PEAK_BF16_FLOP_S = 790e12
# The share of that peak assumed for a large prefill when no rate is given or measured: a prefill is large matrix
# products (compute-bound), and half the tensor-core peak is a round figure engines attain on them.
PREFILL_SHARE_OF_PEAK = 0.5
KV_CACHE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class ExtractMemory:
    engine: str
    gpus_per_worker: int
    gpu_memory_bytes: float
    parameters: int  # the target's, from parameters_source
    active_parameters: int  # one token's (a mixture of experts routes it to num_experts_per_tok experts)
    parameters_source: str
    weight_bytes: float  # what the engine loads, all GPUs together
    weight_bytes_per_gpu: float
    bytes_per_gpu: float  # vLLM: its share of the GPU; Transformers: weights and one pass's activations
    flop_per_token: float  # 2 per parameter of the decoder layers a token goes through
    compute_gpus: int  # GPUs computing at once
    tokens_per_s: float  # the assumed prefill rate per worker
    assumption: str
    # vLLM engine
    gpu_memory_utilization: float | None = None
    kv_cache_bytes_per_token: int | None = None  # per GPU
    hidden_state_cache_bytes_per_token: int | None = None  # per GPU: the same on every one
    tokens_in_flight: int | None = None  # the worker's: each GPU holds its share of every one
    max_model_len: int | None = None
    # Transformers engine
    activation_bytes: float | None = None
    token_budget: int | None = None
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def assumed_prefill_tokens_per_s(flop_per_token: float, compute_gpus: int) -> float:
    return PREFILL_SHARE_OF_PEAK * H200_PEAK_BF16_FLOP_S * compute_gpus / flop_per_token


def describe_assumption(flop_per_token: float, compute_gpus: int, why_gpus: str = "") -> str:
    return (
        f"compute-bound prefill at {PREFILL_SHARE_OF_PEAK:.0%} of {H200_PEAK_BF16_FLOP_S / 1e12:,.0f} TFLOP/s bf16 "
        f"per H200 x {compute_gpus} GPU(s){why_gpus}, over {humanize.count(flop_per_token)} FLOP per token (2 x "
        f"{humanize.count(flop_per_token / 2)} active decoder-layer parameters)"
    )


def extract_memory(
    model: ModelConfig, extract: ExtractConfig, model_config: Any, *, gpus_per_worker: int, gpu_memory_gib: float
) -> ExtractMemory:
    """The extract lane's per-GPU figures for `extract` (its engine) on workers of `gpus_per_worker` GPUs of
    `gpu_memory_gib` each; `model_config` is the checkpoint's Transformers config."""
    text = model_config.get_text_config()
    count = count_parameters(text)
    layer_ids = resolve_layer_ids(extract.layer_ids, len(count.layers), extract.num_draft_layers)
    if extract.engine == "vllm":
        return _vllm(model, extract, model_config, text, count, layer_ids, gpus_per_worker, gpu_memory_gib * GIB)
    return _transformers(model, extract, text, count, layer_ids, gpus_per_worker, gpu_memory_gib * GIB)


def _vllm(
    model: ModelConfig,
    extract: ExtractConfig,
    model_config: Any,
    text: Any,
    count: ParameterCount,
    layer_ids: list[int],
    gpus: int,
    gpu_memory: float,
) -> ExtractMemory:
    settings = extract.vllm
    dtype_bytes = GPU_DTYPE_BYTES[settings.dtype or model.dtype]
    kv_bytes = KV_CACHE_BYTES.get(settings.kv_cache_dtype, dtype_bytes)
    parameters, weight_bytes, source = _checkpoint_weights(model.path, model_config, count, dtype_bytes)
    per_gpu_weights = weight_bytes / gpus
    aux = vllm_aux_layer_ids(extract.captured_entries(len(count.layers)), len(count.layers))
    kv_per_token = kv_cache_bytes_per_token(text, kv_bytes, gpus)
    states_per_token = len(aux) * int(text.hidden_size) * dtype_bytes
    budget = settings.gpu_memory_utilization * gpu_memory
    cache = settings.kv_cache_memory_gib * GIB if settings.kv_cache_memory_gib else budget - per_gpu_weights
    in_flight = max(0, math.floor(cache / (kv_per_token + states_per_token)))
    max_model_len = settings.max_model_len or int(getattr(text, "max_position_embeddings", 0) or 0)  # vLLM's
    flop = 2.0 * sum(count.active_layers)
    warnings = []
    if per_gpu_weights >= budget:
        warnings.append(
            f"the extract engine's weights ({per_gpu_weights / GIB:,.1f} GiB per GPU) do not fit in "
            f"gpu_memory_utilization x {gpu_memory / GIB:,.1f} GiB ({budget / GIB:,.1f} GiB): raise "
            "extract.vllm.tensor_parallel_size"
        )
    elif max_model_len and in_flight < max_model_len:
        warnings.append(
            f"the cache has room for {in_flight:,} tokens in flight, less than one sequence of max_model_len "
            f"{max_model_len:,}: vLLM would not start; raise extract.vllm.tensor_parallel_size or lower "
            "extract.vllm.max_model_len"
        )
    return ExtractMemory(
        engine="vllm",
        gpus_per_worker=gpus,
        gpu_memory_bytes=gpu_memory,
        parameters=parameters,
        active_parameters=count.active,
        parameters_source=source,
        weight_bytes=weight_bytes,
        weight_bytes_per_gpu=per_gpu_weights,
        bytes_per_gpu=budget,
        flop_per_token=flop,
        compute_gpus=gpus,
        tokens_per_s=assumed_prefill_tokens_per_s(flop, gpus),
        assumption=describe_assumption(flop, gpus),
        gpu_memory_utilization=settings.gpu_memory_utilization,
        kv_cache_bytes_per_token=kv_per_token,
        hidden_state_cache_bytes_per_token=states_per_token,
        tokens_in_flight=in_flight,
        max_model_len=max_model_len,
        warnings=warnings,
    )


def _transformers(
    model: ModelConfig,
    extract: ExtractConfig,
    text: Any,
    count: ParameterCount,
    layer_ids: list[int],
    gpus: int,
    gpu_memory: float,
) -> ExtractMemory:
    dtype_bytes = GPU_DTYPE_BYTES[model.dtype]  # "auto" is bfloat16 on a GPU
    kept = len(count.layers) if extract.final_norm_state or extract.last_layer_state else max(layer_ids) + 1
    loaded = count.embedding + sum(count.layers[:kept]) + count.final_norm  # AutoModel: no LM head
    weight_bytes = float(loaded * dtype_bytes)
    captured = len(extract.captured_entries(len(count.layers)))
    activations = float(pass_activation_bytes(text, extract.token_budget, captured, dtype_bytes))
    per_gpu = weight_bytes / gpus + activations
    flop = 2.0 * sum(count.active_layers[:kept])
    why = " (a group's layers run one GPU after another)" if gpus > 1 else ""
    warnings = []
    if per_gpu > gpu_memory:
        warnings.append(
            f"the extract engine needs {per_gpu / GIB:,.1f} GiB per GPU (weights and a pass of "
            f"{extract.token_budget:,} tokens) of {gpu_memory / GIB:,.1f} GiB: give its workers more GPUs, or "
            "lower extract.token_budget"
        )
    return ExtractMemory(
        engine="transformers",
        gpus_per_worker=gpus,
        gpu_memory_bytes=gpu_memory,
        parameters=count.total,
        active_parameters=count.active,
        parameters_source="config shapes",
        weight_bytes=weight_bytes,
        weight_bytes_per_gpu=weight_bytes / gpus,
        bytes_per_gpu=per_gpu,
        flop_per_token=flop,
        compute_gpus=1,
        tokens_per_s=assumed_prefill_tokens_per_s(flop, 1),
        assumption=describe_assumption(flop, 1, why),
        activation_bytes=activations,
        token_budget=extract.token_budget,
        warnings=warnings,
    )


def _checkpoint_weights(
    path: str, model_config: Any, count: ParameterCount, dtype_bytes: int
) -> tuple[int, float, str]:
    """(parameters, weight bytes as the engine holds them, where the figure comes from). A sharded checkpoint's
    index states its bytes (every weight, a vision tower too): parameters are those bytes over the checkpoint's
    dtype, and a quantized checkpoint's weights stay as stored. Otherwise the config's shapes."""
    total_size = checkpoint_total_size(path)
    if total_size is None:
        return count.total, float(count.total * dtype_bytes), "config shapes"
    if getattr(model_config, "quantization_config", None):
        return count.total, float(total_size), "checkpoint index (metadata.total_size, quantized as stored)"
    stored = getattr(model_config, "dtype", None)
    stored_bytes = getattr(stored, "itemsize", None) or dtype_bytes
    parameters = total_size // stored_bytes
    return parameters, float(parameters * dtype_bytes), f"checkpoint index (metadata.total_size / {stored_bytes} bytes)"
