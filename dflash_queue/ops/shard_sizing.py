"""How large one training shard will be, and how much host memory and staging disk an extract worker needs.

An extract task streams each forward pass's states to its staged shard file (lanes/extract.py), so its host
memory follows the token budget, not the shard: the states of two passes (the one being written and, on CUDA,
the next one copying to pinned memory), one sequence converted to the stored dtype (fp8 quantises from a
float32 copy), and the canary's copies of its samples. One task computes at a time; the worker's other task
slots wait on the staging disk or the compute slot and hold their shard's token ids only. On a CPU the forward
pass's activations are host memory too (`activation_bytes`, as the engine estimates them).

The vLLM engine hands each finished sequence over whole (engines/vllm/extract.py): each of its
extract.vllm.inflight_tasks computing tasks holds one sequence as read, its converted copy and its canary copies,
and the transfer tmpfs holds about one more sequence per task, in memory too.

`tools/bench_extract_memory.py` measures the peak RSS growth of real extract tasks against this estimate.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from dflash_queue.data.config import DatasetConfig
from dflash_queue.engines.config import ModelConfig
from dflash_queue.engines.devices import GPU_DTYPE_BYTES
from dflash_queue.lanes.config import ExtractConfig
from dflash_queue.lanes.registry import extract_slots
from dflash_queue.storage.config import UploaderConfig

STORED_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8_e4m3": 1}
MODEL_BYTES = GPU_DTYPE_BYTES  # model.dtype "auto" on a GPU: the checkpoint's, bf16 for the models targeted


def shard_bytes(samples: int, tokens_per_sample: float, num_layers: int, hidden_size: int, hidden_dtype: str) -> float:
    """The shard file: states, token ids (int32), loss mask (uint8), fp8 scales (float32 per token and layer) and
    offsets; the header (a few hundred bytes per sample) is left out."""
    per_token = num_layers * hidden_size * STORED_BYTES[hidden_dtype] + 4 + 1
    if hidden_dtype == "fp8_e4m3":
        per_token += 4 * num_layers
    return samples * tokens_per_sample * per_token + 8 * (samples + 1)


def task_host_bytes(
    *,
    token_budget: int,
    longest_tokens: float,
    num_layers: int,
    hidden_size: int,
    model_bytes: int,
    hidden_dtype: str,
    canary_samples: int,
    activation_bytes: float = 0.0,
) -> float:
    """Host memory of the computing extract task beyond the model's weights (see the module docstring)."""
    per_token = num_layers * hidden_size
    pass_tokens = max(token_budget, longest_tokens)  # a longer sequence runs alone
    converted = 4 if hidden_dtype == "fp8_e4m3" else STORED_BYTES[hidden_dtype]
    return (
        2 * pass_tokens * per_token * model_bytes
        + longest_tokens * per_token * converted
        + canary_samples * longest_tokens * per_token * model_bytes
        + activation_bytes
    )


@dataclass(frozen=True)
class ShardSizing:
    samples: int
    tokens_per_sample: float
    shard_bytes: float
    max_shard_bytes: int
    task_slots: int
    computing_tasks: int  # tasks on the engine at once
    task_host_bytes: float  # the computing tasks together, beyond the model's weights
    staging_bytes: float  # shards staged or uploading at once, on the worker's disk

    @property
    def too_large(self) -> bool:
        return self.shard_bytes > self.max_shard_bytes

    def to_dict(self) -> dict:
        return asdict(self) | {"too_large": self.too_large}


def size_shards(
    extract: ExtractConfig,
    dataset: DatasetConfig,
    uploader: UploaderConfig,
    model: ModelConfig,
    *,
    num_layers: int,
    hidden_size: int,
    tokens_per_sample: float,
) -> ShardSizing:
    """The sizes for these settings with samples of `tokens_per_sample` tokens (prompt and completion), for a
    model of `num_layers` stored layers of `hidden_size` values."""
    samples = dataset.shard_size
    size = shard_bytes(samples, tokens_per_sample, num_layers, hidden_size, extract.hidden_dtype)
    max_pending = uploader.max_pending
    model_bytes = MODEL_BYTES[model.dtype]
    if extract.engine == "vllm":
        computing = extract.vllm.inflight_tasks
        sequence = tokens_per_sample * num_layers * hidden_size
        converted = 4 if extract.hidden_dtype == "fp8_e4m3" else STORED_BYTES[extract.hidden_dtype]
        engine_bytes = MODEL_BYTES[extract.vllm.dtype or model.dtype]
        # Read, waiting in the tmpfs, converted, and the canary's copies.
        host = computing * sequence * (2 * engine_bytes + converted + extract.canary_samples * engine_bytes)
    else:
        computing = 1
        host = task_host_bytes(
            token_budget=extract.token_budget,
            longest_tokens=tokens_per_sample,
            num_layers=num_layers,
            hidden_size=hidden_size,
            model_bytes=model_bytes,
            hidden_dtype=extract.hidden_dtype,
            canary_samples=extract.canary_samples,
        )
    return ShardSizing(
        samples=samples,
        tokens_per_sample=tokens_per_sample,
        shard_bytes=size,
        max_shard_bytes=extract.max_shard_bytes,
        task_slots=extract_slots(extract, uploader),
        computing_tasks=computing,
        task_host_bytes=host,
        staging_bytes=max_pending * size,
    )
