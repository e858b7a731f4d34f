"""Whether vLLM can extract a target's hidden states exactly, from its config alone, and the settings the extract
lane's vLLM engine forces (with why). Read by the engine at load and by `doctor`."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Where the extract engine hands states over when extract.vllm.transfer_dir is empty: memory (tmpfs).
DEFAULT_TRANSFER_DIR = Path("/dev/shm")

# Settings the extract lane's vLLM engine always runs with, and why: told by `doctor` and the worker's log.
FORCED_SETTINGS = (
    ("prefix caching off", "a cached prefix is not recomputed, and its states are missing (vLLM #44485)"),
    ("one generated token per sequence, greedy", "extraction is a prefill; the token itself is thrown away"),
)


def vllm_refusal(config: Any) -> str | None:
    """Why vLLM cannot extract this target's states exactly (None: it can). `config` is the checkpoint's config
    (a multimodal one included)."""
    architectures = list(getattr(config, "architectures", None) or [])
    if not architectures:
        return f"{getattr(config, 'model_type', '?')}: config.json names no architecture for vLLM to load"
    refusal = _known_divergence(config)
    if refusal:
        return refusal
    try:
        from vllm.model_executor.models import ModelRegistry
        from vllm.model_executor.models.interfaces import supports_eagle3
    except ImportError as exc:
        return f"vLLM is not installed ({exc}): install the [vllm] extra"
    architecture = architectures[0]
    model_class = ModelRegistry._try_load_model_cls(architecture)
    if model_class is None:
        return (
            f"vLLM {_version()} cannot load {architecture} here (its model module failed to import: see the log "
            "above)"
        )
    if not supports_eagle3(model_class):
        return (
            f"vLLM's {model_class.__name__} does not hand out the residual stream of its layers (no EAGLE-3 aux "
            "hidden states), so extract_hidden_states cannot run on it: use extract.engine = \"transformers\""
        )
    return None


def _known_divergence(config: Any) -> str | None:
    """Targets whose vLLM model code computes something else than the checkpoint's own class."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "model_type", "") == "gpt_oss":
        kinds = list(getattr(text, "layer_types", None) or [])
        # vLLM's gpt-oss gives a sliding window to every even layer, whatever config.layer_types says.
        assumed = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(len(kinds))]
        if kinds and kinds != assumed:
            return (
                "gpt_oss: vLLM puts a sliding window on every other layer (0, 2, 4, ...) whatever config.layer_types "
                "says, and this checkpoint's layer_types differ, so its states would not be the model's: use "
                "extract.engine = \"transformers\""
            )
    return None


def _version() -> str:
    try:
        import vllm

        return str(vllm.__version__)
    except ImportError:
        return "?"
