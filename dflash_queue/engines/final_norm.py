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

from dflash_queue.engines.decoder import (
    CheckpointLayout,
    checkpoint_keys,
    checkpoint_tensors,
    decoder_prefix,
    read_layout,
)
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
    keys = checkpoint_keys(directory)
    prefix = decoder_prefix(keys, layout)
    wanted = {f"{prefix}{_NORM}.{name}": name for name, _ in norm.named_parameters()}
    found = {wanted[key]: tensor for key, tensor in checkpoint_tensors(directory, wanted).items()}
    missing = sorted(key for key, name in wanted.items() if name not in found)
    if missing:
        raise UnsupportedArchitecture(
            f"{directory}: the final norm's weights {missing} are not in the checkpoint; the final-norm state "
            "cannot be computed"
        )
    norm.load_state_dict(found, strict=True)
