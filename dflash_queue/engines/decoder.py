"""Loading the target's text decoder, from a text-only or a multimodal checkpoint, with every weight checked.

A multimodal checkpoint (Qwen3.5's `Qwen3_5ForConditionalGeneration`, Gemma 3's `Gemma3ForConditionalGeneration`)
holds its text decoder under a prefix such as `model.language_model.`. Only that decoder is loaded: the text
config decides the class (`AutoModel` / `AutoModelForCausalLM` of the text config's type) and the prefix is
mapped away (`key_mapping`), so no vision tower is built or read.

Every load asks Transformers which weights it did not find: a decoder with a weight left at its random
initialisation computes states that look plausible and are worthless, so a missing weight refuses the load.

For generation, `hf/causal_lm.load_causal_lm` puts this decoder under its LM head.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dflash_queue.errors import UnsupportedArchitecture

_INDEX = "model.safetensors.index.json"
_EMBEDDINGS = "embed_tokens.weight"
HEAD = "lm_head.weight"
# Where multimodal checkpoints keep their text decoder, most specific first (checked against the actual keys).
_TEXT_PREFIX_HINTS = ("language_model", "text_model", "llm")


@dataclass(frozen=True)
class CheckpointLayout:
    """What a checkpoint directory holds: its config, the text decoder's config, and the key prefix of the text
    decoder's weights ("" for a text-only checkpoint whose base model is the decoder)."""

    config: object
    text_config: object
    text_prefix: str | None
    head_prefix: str = ""  # where the LM head's weight sits ("" or e.g. "language_model.")

    @property
    def multimodal(self) -> bool:
        return self.text_config is not self.config

    @property
    def model_type(self) -> str:
        return str(getattr(self.config, "model_type", "?"))

    @property
    def text_model_type(self) -> str:
        return str(getattr(self.text_config, "model_type", "?"))


def read_layout(path: str) -> CheckpointLayout:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    text_config = config.get_text_config()
    if text_config is config:
        return CheckpointLayout(config, text_config, None)
    keys = checkpoint_keys(Path(path)) if Path(path).is_dir() else []
    heads = [key[: -len(HEAD)] for key in keys if key.endswith(HEAD)]
    return CheckpointLayout(config, text_config, _text_decoder_prefix(keys), heads[0] if len(heads) == 1 else "")


def load_text_decoder(
    path: str,
    *,
    dtype: torch.dtype,
    device: torch.device,
    attn_implementation: str,
    layout: CheckpointLayout | None = None,
    device_map: Mapping[str, int | str] | None = None,
    num_layers: int | None = None,
) -> nn.Module:
    """The base (no LM head) text decoder of the checkpoint at `path` (whose `layout` the caller may have read
    already), on `device` or placed module by module by `device_map` (the decoder's module names, as
    `spread_device_map` gives them), every weight loaded; only its first `num_layers` decoder layers when given
    (the others' weights are never read)."""
    from transformers import AutoModel

    layout = layout or read_layout(path)
    kwargs = load_kwargs(layout, dtype, device, attn_implementation)
    if num_layers is not None:
        kwargs["config"] = truncated_config(layout.text_config, num_layers)
    if device_map is not None:
        kwargs["device_map"] = dict(device_map)
    model, info = AutoModel.from_pretrained(path, output_loading_info=True, **kwargs)
    require_complete(model, info, path, layout)
    return model if device_map is not None else model.to(device)


def spread_device_map(path: str, layout: CheckpointLayout, gpu_count: int) -> dict[str, int]:
    """`decoder_device_map` for the decoder of the checkpoint at `path`: any other top-level module holding
    weights (LFM2's final `embedding_norm`) goes to the first GPU with the embeddings. Modules on different GPUs
    are joined by accelerate's hooks, which move each module's inputs to its GPU."""
    from dflash_queue.engines.devices import decoder_device_map

    text: Any = layout.text_config
    mapping = decoder_device_map(int(text.num_hidden_layers), gpu_count)
    keys = checkpoint_keys(Path(path))
    prefix = decoder_prefix(keys, layout)
    for key in keys:
        if key.startswith(prefix):
            module = key[len(prefix):].split(".", 1)[0]
            if module != "layers" and module not in mapping:
                mapping[module] = 0
    return mapping


def truncated_config(text_config: Any, num_layers: int) -> Any:
    """A copy of a text config with its first `num_layers` decoder layers only."""
    import copy

    config = copy.deepcopy(text_config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = list(config.layer_types)[:num_layers]
    return config


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise UnsupportedArchitecture(
            f"{type(model).__name__} ({getattr(model.config, 'model_type', '?')}) has no list of decoder layers "
            "('layers'); the extraction engine hooks decoder layers and cannot run this architecture"
        )
    return layers


def load_kwargs(layout: CheckpointLayout, dtype: torch.dtype, device: torch.device, attn: str | None) -> dict:
    kwargs: dict = {"dtype": dtype}
    if attn is not None:
        kwargs["attn_implementation"] = attn
    if device.type == "cuda":
        kwargs["device_map"] = str(device)  # straight to the GPU, never a full host copy
    if layout.multimodal:
        if not layout.text_prefix:
            raise UnsupportedArchitecture(
                f"{layout.model_type}: a multimodal checkpoint whose text decoder weights were not found (no "
                f"'*{_EMBEDDINGS}' under a language-model prefix)"
            )
        kwargs["config"] = layout.text_config
        kwargs["key_mapping"] = {f"^{re.escape(layout.text_prefix)}": ""}
    return kwargs


def require_complete(model: nn.Module, info: dict, path: str, layout: CheckpointLayout) -> None:
    missing = sorted(info.get("missing_keys") or ())
    mismatched = sorted(str(k) for k in (info.get("mismatched_keys") or ()))
    tied = {name for name, _ in _tied_parameters(model)}
    missing = [name for name in missing if name not in tied]
    if missing or mismatched:
        shown = ", ".join((missing + mismatched)[:6]) + (" ..." if len(missing) + len(mismatched) > 6 else "")
        raise UnsupportedArchitecture(
            f"{path}: {layout.text_model_type} loads with {len(missing)} weights missing and {len(mismatched)} of "
            f"the wrong shape ({shown}); they would run at their random initialisation"
        )


def _tied_parameters(model: nn.Module):
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    return tied.items() if isinstance(tied, dict) else ()


def decoder_prefix(keys: list[str], layout: CheckpointLayout) -> str:
    """The key prefix of the text decoder's weights in a checkpoint with these `keys` (`model.` for a causal LM,
    `model.language_model.` for a multimodal checkpoint, "" for a bare decoder)."""
    if layout.text_prefix:
        return layout.text_prefix
    prefix = _text_decoder_prefix(keys)
    if prefix is None:
        raise UnsupportedArchitecture(
            f"{layout.model_type}: cannot tell where the checkpoint keeps its decoder (no single prefix holding "
            f"'{_EMBEDDINGS}' and 'layers.0.')"
        )
    return prefix


def checkpoint_keys(directory: Path) -> list[str]:
    index = directory / _INDEX
    if index.is_file():
        return list(json.loads(index.read_text(encoding="utf-8"))["weight_map"])
    from safetensors import safe_open

    keys: list[str] = []
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            keys.extend(handle.keys())
    return keys


def checkpoint_tensors(directory: Path, keys: Iterable[str]) -> dict[str, torch.Tensor]:
    """The tensors of `keys` that the checkpoint in `directory` holds, as stored, on the CPU (keys it does not hold
    are left out)."""
    from safetensors import safe_open

    wanted = set(keys)
    index = directory / _INDEX
    files: dict[str, list[str]] = {}
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        for key in sorted(wanted & set(weight_map)):
            files.setdefault(weight_map[key], []).append(key)
    else:
        for file in sorted(directory.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as handle:
                held = sorted(wanted & set(handle.keys()))
            if held:
                files[file.name] = held
    found: dict[str, torch.Tensor] = {}
    for name, held_keys in files.items():
        with safe_open(str(directory / name), framework="pt") as handle:
            for key in held_keys:
                found[key] = handle.get_tensor(key)
    return found


def _text_decoder_prefix(keys: list[str]) -> str | None:
    """The prefix under which the checkpoint stores its text decoder (`model.language_model.`), found from the
    weight names: the one holding both `embed_tokens.weight` and `layers.0.` weights."""
    candidates = []
    for key in keys:
        if key.endswith(_EMBEDDINGS):
            prefix = key[: -len(_EMBEDDINGS)]
            if any(k.startswith(f"{prefix}layers.0.") for k in keys):
                candidates.append(prefix)
    for hint in _TEXT_PREFIX_HINTS:
        for prefix in candidates:
            if hint in prefix:
                return prefix
    return candidates[0] if len(candidates) == 1 else None
