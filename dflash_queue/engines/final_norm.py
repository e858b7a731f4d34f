"""The target's final norm on its own, for engines that hand over the last layer's output before it.

vLLM's aux layer id N (N decoder layers) is the residual stream after the last layer, before the final norm; the
`final_norm` entry of a shard is that state after the norm. Applying the checkpoint's own norm module (its class
from Transformers, built from the text config, with the checkpoint's own weights) gives what the Transformers
engine captures after `model.norm`, whatever the family's norm computes (RMSNorm, Gemma's 1 + weight, ...).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from dflash_queue.engines.decoder import CheckpointLayout, checkpoint_keys, read_layout
from dflash_queue.errors import UnsupportedArchitecture

_NORM = "norm"


class FinalNorm:
    """The decoder's final norm module with the checkpoint's weights, on the CPU, in `dtype`."""

    def __init__(self, model_path: str, dtype: torch.dtype, layout: CheckpointLayout | None = None) -> None:
        layout = layout or read_layout(model_path)
        self.module = _norm_module(layout).to(dtype)
        self.dtype = dtype
        _load_weights(self.module, Path(model_path), layout)
        self.module.eval()

    @torch.inference_mode()
    def __call__(self, states: torch.Tensor) -> torch.Tensor:
        """[T, H] states before the norm -> after it, in the norm's dtype."""
        return self.module(states.to(self.dtype))


def _norm_module(layout: CheckpointLayout) -> nn.Module:
    from transformers import AutoModel

    with torch.device("meta"):
        decoder: Any = AutoModel.from_config(layout.text_config)
    norm = getattr(decoder, _NORM, None)
    if not isinstance(norm, nn.Module):
        raise UnsupportedArchitecture(
            f"{layout.text_model_type} has no final norm module ('{_NORM}'): extract.final_norm_state needs one"
        )
    return norm.to_empty(device="cpu")


def _load_weights(norm: nn.Module, directory: Path, layout: CheckpointLayout) -> None:
    """The norm's parameters from the checkpoint: `<decoder prefix>norm.<name>` for each of them."""
    from safetensors import safe_open

    from dflash_queue.engines.decoder import decoder_prefix

    keys = checkpoint_keys(directory)
    prefix = decoder_prefix(keys, layout)
    wanted = {f"{prefix}{_NORM}.{name}": name for name, _ in norm.named_parameters()}
    files = _files_of(directory, set(wanted))
    found: dict[str, torch.Tensor] = {}
    for file, names in files.items():
        with safe_open(str(directory / file), framework="pt") as handle:
            for key in names:
                found[wanted[key]] = handle.get_tensor(key)
    missing = sorted(set(wanted) - {key for key, name in wanted.items() if name in found})
    if missing:
        raise UnsupportedArchitecture(
            f"{directory}: the final norm's weights {missing} are not in the checkpoint; the final-norm state "
            "cannot be computed"
        )
    norm.load_state_dict(found, strict=True)


def _files_of(directory: Path, keys: set[str]) -> dict[str, list[str]]:
    """safetensors file name -> the wanted keys it holds."""
    import json

    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        out: dict[str, list[str]] = {}
        for key in keys:
            if key in weight_map:
                out.setdefault(weight_map[key], []).append(key)
        return out
    from safetensors import safe_open

    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            held = keys & set(handle.keys())
        if held:
            out[file.name] = sorted(held)
    return out
