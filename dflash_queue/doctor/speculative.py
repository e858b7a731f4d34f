"""Whether the generate lane's speculative decoding (`generate.vllm.engine_args.speculative_config`) can run on
this checkpoint: MTP runs the target's own multi-token-prediction layers, which its config must declare and its
weights hold (a checkpoint saved by Transformers has lost them: its model classes drop them when they load); a
draft model must be named; n-gram and suffix decoding need no weights."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from dflash_queue.doctor.result import Check
from dflash_queue.engines.config import GenerateConfig, ModelConfig
from dflash_queue.engines.decoder import checkpoint_keys

NAME = "speculative decoding"
# Methods that propose from the tokens already there, without weights of their own.
WEIGHTLESS = ("ngram", "ngram_gpu", "suffix")
# Where checkpoints declare how many MTP layers they ship: DeepSeek-V3, GLM-4.5, Qwen3-Next, MiMo, ... and
# Qwen3.5 / Qwen3.6.
MTP_LAYER_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# A multimodal checkpoint's encoders have layers of their own, more of them than the decoder at times.
_ENCODERS = ("visual", "vision", "audio")


def is_mtp(method: str) -> bool:
    return method == "mtp" or method.endswith("_mtp")


def declared_mtp_layers(model_config: Any) -> int:
    """MTP layers the checkpoint's config declares (0: none)."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    for source in (text, model_config):
        for key in MTP_LAYER_KEYS:
            value = getattr(source, key, None)
            if isinstance(value, int) and value > 0:
                return value
    return 0


def mtp_weights(keys: list[str], num_hidden_layers: int) -> list[str]:
    """Tensors of MTP layers: named `mtp` (Qwen3.5, Qwen3-Next, MiMo), or decoder layers past the last one
    (DeepSeek-V3, GLM-4.5 store their MTP layers as layer N, N+1, ...)."""
    found = []
    for key in keys:
        if any(part in key for part in _ENCODERS):
            continue
        layer = _LAYER.search(key)
        if "mtp" in key.split(".")[0] or ".mtp" in key or (layer and int(layer.group(1)) >= num_hidden_layers):
            found.append(key)
    return found


def check_speculative(generate: GenerateConfig, model: ModelConfig, model_config: Any) -> Check | None:
    """None when the generate lane runs no speculative decoding."""
    if generate.engine != "vllm":
        return None
    spec = generate.vllm.engine_args.get("speculative_config")
    if not isinstance(spec, dict):
        return None
    method = str(spec.get("method") or "")
    tokens = spec.get("num_speculative_tokens")
    proposes = f"{tokens} token(s) a step" if tokens else "vLLM's default number of tokens a step"
    if method in WEIGHTLESS:
        return Check.passed(NAME, f"method {method!r}, {proposes}: proposes from the tokens already there, no weights")
    if is_mtp(method):
        return _check_mtp(model, model_config, method, proposes)
    draft = spec.get("model")
    if not draft:
        return Check.failed(NAME, f"method {method!r} needs a draft model: set speculative_config.model")
    if str(draft).startswith(("/", ".", "~")) and not Path(str(draft)).expanduser().exists():
        return Check.failed(NAME, f"method {method!r}: the draft model {draft} does not exist")
    return Check.passed(NAME, f"method {method!r}, draft {draft}, {proposes}")


def _check_mtp(model: ModelConfig, model_config: Any, method: str, proposes: str) -> Check:
    path = model.path
    declared = declared_mtp_layers(model_config)
    if not declared:
        return Check.failed(
            NAME,
            f"method {method!r} runs the target's own multi-token-prediction layers, and {path}'s config declares "
            f"none ({' / '.join(MTP_LAYER_KEYS)}): use a checkpoint that ships them, or another method (ngram, a "
            "draft model)",
        )
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    try:
        keys = checkpoint_keys(Path(path))
    except OSError as exc:
        return Check.warned(NAME, f"method {method!r}: cannot list the weights of {path} ({exc})")
    if not keys:
        return Check.warned(NAME, f"method {method!r}: {path}'s config declares {declared} MTP layer(s); it holds no "
                                  "weights to look for them in")
    found = mtp_weights(keys, int(getattr(text, "num_hidden_layers", 0) or 0))
    if not found:
        return Check.failed(
            NAME,
            f"method {method!r}: {path}'s config declares {declared} MTP layer(s) but its weights hold none (no "
            "mtp.* tensors, no layers past the last decoder layer): the checkpoint was saved without them "
            "(Transformers drops them); use the checkpoint as released",
        )
    return Check.passed(NAME, f"method {method!r}: {declared} MTP layer(s) in the checkpoint ({len(found)} tensors), "
                              f"{proposes}")
