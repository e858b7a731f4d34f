"""Whether vLLM can extract a target's hidden states exactly, from its config alone, the settings the extract
lane's vLLM engine forces (with why), and the room its transfer directory needs. Read by the engine at load and by
`doctor`."""

from __future__ import annotations

import logging
import math
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_queue.engines.config import ExtractEngineSettings, ModelConfig
from dflash_queue.engines.devices import GPU_DTYPE_BYTES
from dflash_queue.engines.layers import vllm_aux_layer_ids

log = logging.getLogger(__name__)
GB = 1000**3

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


@dataclass(frozen=True)
class VllmExtractSettings:
    """What the extract lane's vLLM engine is built from: the model and extract sections, and the few figures it
    takes from the rest of the configuration."""

    model: ModelConfig
    extract: ExtractEngineSettings
    context_len: int
    """The engine's max_model_len: extract.vllm.max_model_len, else the longest sequence staging admits plus one."""
    shard_size: int
    """Samples per task (dataset.shard_size): every task in flight submits its shard at once."""
    canary_tolerance: float = 0.0
    """extract.canary_tolerance; 0: calibrated when the engine loads."""
    source: str = "<memory>"
    """The configuration file, named in errors."""
    connector_faults: Mapping[str, Any] = field(default_factory=dict)
    """What the KV connector alters on purpose (the test suite's `faults.vllm_states_faults`); empty normally."""


# ---------------------------------------------------------------------------------------------------------------
# The transfer directory's room


def sample_states_bytes(settings: VllmExtractSettings, text_config: Any) -> int:
    """The states the connector hands over for one sequence of the engine's whole context (max_model_len tokens),
    at every aux layer the engine caches, in its dtype: the largest file in the transfer directory."""
    num_layers = int(text_config.num_hidden_layers)
    aux = vllm_aux_layer_ids(settings.extract.captured_entries(num_layers), num_layers)
    dtype_bytes = GPU_DTYPE_BYTES[settings.extract.vllm.dtype or settings.model.dtype]
    return settings.context_len * len(aux) * int(text_config.hidden_size) * dtype_bytes


def transfer_bytes(settings: VllmExtractSettings, text_config: Any) -> int:
    """Room the transfer directory needs: one maximal sequence's states for each task in flight
    (extract.vllm.inflight_tasks); the directory holds a few sequences at a time."""
    return sample_states_bytes(settings, text_config) * settings.extract.vllm.inflight_tasks


def transfer_room_shortfall(settings: VllmExtractSettings, text_config: Any, directory: Path) -> str | None:
    """Why `directory` cannot take the states of extract.vllm.inflight_tasks maximal sequences (None: it can),
    with the settings and the container option that fix it. The worker refuses to start on it; `doctor` fails."""
    free = shutil.disk_usage(directory).free
    needed = transfer_bytes(settings, text_config)
    if free >= needed:
        return None
    one = sample_states_bytes(settings, text_config)
    shm_gb = max(1, math.ceil(needed * 1.25 / 1024**3))
    return (
        f"the transfer directory {directory} has {_size(free)} free, less than the {_size(needed)} that "
        f"extract.vllm.inflight_tasks ({settings.extract.vllm.inflight_tasks}) sequences of max_model_len "
        f"({settings.context_len:,} tokens, {_size(one)} of states each) need: give the container more "
        f"shared memory (docker run --shm-size={shm_gb}g), point extract.vllm.transfer_dir at a larger tmpfs, or "
        "lower extract.vllm.inflight_tasks or extract.vllm.max_model_len"
    )


def _size(count: float) -> str:
    return f"{count / GB:,.2f} GB" if count >= GB else f"{count / 1000**2:,.1f} MB"
