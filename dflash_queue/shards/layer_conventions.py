"""What "layer i" means, and converting layer ids between the conventions of this project and its peers.

Every convention here is an offset from the one this project writes, `decoder_layer_output` (layer i is the
output of decoder layer i, before the final norm, which Transformers returns as `hidden_states[i + 1]`):

* `decoder_layer_output`: this project; SpecForge's DFlash `target_layer_ids` (it reads
  `hidden_states[layer_id + 1]`).
* `hf_hidden_states_index`: an index into Transformers' `hidden_states` tuple (0 is the embedding output). Its
  last entry, N, is after the final norm.
* `vllm_aux_layer`: vLLM's aux hidden-state layers (speculators' `--target-layer-ids`): k is the residual stream
  before decoder layer k runs, the output of layer k - 1, the same as Transformers' index for k < N; k = N is the
  last layer's output before the final norm.

A shard whose metadata names another convention, or contradicts itself, is refused: converting it would shift
every layer by one without anyone noticing.
"""

from __future__ import annotations

from collections.abc import Sequence

from dflash_queue.errors import ShardFormatError
from dflash_queue.shards.reader import ShardIndex
from dflash_queue.shards.training_format import HF_HIDDEN_STATES_INDEX, LAYER_CONVENTION

DECODER_LAYER_OUTPUT = LAYER_CONVENTION
HF_INDEX = "hf_hidden_states_index"
VLLM_AUX_LAYER = "vllm_aux_layer"
OFFSETS = {DECODER_LAYER_OUTPUT: 0, HF_INDEX: 1, VLLM_AUX_LAYER: 1}


class LayerConventionError(ShardFormatError):
    """Layer ids whose meaning is unknown or inconsistent: not converted."""


def convert_layer_ids(layer_ids: Sequence[int], source: str, target: str) -> list[int]:
    for name in (source, target):
        if name not in OFFSETS:
            raise LayerConventionError(f"unknown layer convention {name!r} (known: {sorted(OFFSETS)})")
    shift = OFFSETS[target] - OFFSETS[source]
    return [layer + shift for layer in layer_ids]


def checked_layer_ids(index: ShardIndex) -> tuple[list[int], int]:
    """The shard's layer ids in `decoder_layer_output` terms and its model's layer count, after checking that
    the metadata says what they mean and that they fit the model."""
    meta = index.metadata
    convention = meta.get("layer_convention")
    if convention not in OFFSETS:
        raise LayerConventionError(
            f"{index.where}: layer_convention {convention!r} is not one this exporter knows ({sorted(OFFSETS)}); "
            "refusing to convert layer ids of unknown meaning"
        )
    hf_index = meta.get("hf_hidden_states_index", HF_HIDDEN_STATES_INDEX)
    if convention == DECODER_LAYER_OUTPUT and hf_index != HF_HIDDEN_STATES_INDEX:
        raise LayerConventionError(
            f"{index.where}: hf_hidden_states_index {meta['hf_hidden_states_index']!r} contradicts "
            f"layer_convention {convention!r} (expected {HF_HIDDEN_STATES_INDEX!r})"
        )
    try:
        num_layers = int(meta["num_model_layers"])
    except (KeyError, ValueError):
        raise LayerConventionError(f"{index.where}: metadata num_model_layers is missing or not an integer") from None
    layers = convert_layer_ids(index.layer_ids, convention, DECODER_LAYER_OUTPUT)
    outside = [layer for layer in layers if not 0 <= layer < num_layers]
    if outside:
        raise LayerConventionError(f"{index.where}: layer ids {outside} outside a model of {num_layers} layers")
    return layers, num_layers
