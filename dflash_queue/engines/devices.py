"""Device and dtype choices shared by the Transformers engines."""

from __future__ import annotations

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Bytes per value of each dtype setting on a GPU. "auto" is the checkpoint's dtype: bfloat16 for the models this
# project targets (and vLLM casts a float32 checkpoint down to 16 bits under "auto").
GPU_DTYPE_BYTES = {"auto": 2, "bfloat16": 2, "float16": 2, "float32": 4}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("model.device is 'cuda' but no CUDA device is visible")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[dtype]


def spread_gpu_count(device: str) -> int:
    """GPUs the Transformers extract engine spreads its decoder over: every visible CUDA device when model.device
    is "auto" (a worker's GPU group), else one."""
    if device == "auto" and torch.cuda.is_available():
        return max(1, torch.cuda.device_count())
    return 1


def decoder_device_map(num_layers: int, gpu_count: int) -> dict[str, int]:
    """A device map placing a Transformers text decoder over `gpu_count` GPUs: its layers in contiguous runs (the
    first GPUs take one layer more when the count does not divide evenly), the embeddings and the rotary
    embeddings on the first GPU, the final norm on the last. Keys are the decoder's module names."""
    if num_layers < 1 or gpu_count < 1:
        raise ValueError(f"cannot place {num_layers} layers on {gpu_count} GPUs")
    mapping = {"embed_tokens": 0, "rotary_emb": 0}
    per_gpu, extra = divmod(num_layers, gpu_count)
    layer = 0
    for gpu in range(gpu_count):
        for _ in range(per_gpu + (gpu < extra)):
            mapping[f"layers.{layer}"] = gpu
            layer += 1
    mapping["norm"] = gpu_count - 1
    return mapping
