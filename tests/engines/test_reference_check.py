"""The comparison of an engine's states with the checkpoint's own Transformers forward (engines/reference_check.py),
without vLLM: states from the checkpoint's full model (dfq_testing.references, another code path: the whole model,
`output_hidden_states`) agree with the check's truncated forward; states one slot off, of the neighbouring layer or
through no final norm are refused, naming the layer; bfloat16 is held to what its own rounding explains. The vLLM
engine's own comparison at load is in tests/engines/test_vllm_extract_bfloat16.py."""

from __future__ import annotations

import random
import re

import pytest
import torch

from dflash_queue.engines.reference_check import (
    FLOORS,
    ROUNDING_FACTOR,
    ReferenceMismatch,
    compare_with_reference,
    entries_to_compare,
    float32_bytes,
    require_agreement,
)
from dflash_queue.errors import UnsupportedArchitecture
from dfq_testing.families import NUM_LAYERS
from dfq_testing.references import reference_model, reference_states

CAPTURED = [(1, "decoder_output"), (3, "decoder_output"), (NUM_LAYERS - 1, "last_layer"), (NUM_LAYERS - 1, "final_norm")]


def probe(length: int = 40) -> list[int]:
    rng = random.Random(0)
    return [rng.randrange(1000) for _ in range(length)]


def test_the_entries_compared_are_those_within_the_loaded_layers_and_at_least_the_lowest():
    assert entries_to_compare(CAPTURED, NUM_LAYERS, 4) == ([0, 1], 4)
    assert entries_to_compare(CAPTURED, NUM_LAYERS, 1) == ([0], 2)  # the lowest captured layer, whatever the budget
    # Every layer loaded: the last layer and the final norm too.
    assert entries_to_compare(CAPTURED, NUM_LAYERS, 100) == ([0, 1, 2, 3], NUM_LAYERS)
    assert entries_to_compare([(4, "decoder_output"), (0, "decoder_output")], NUM_LAYERS, 2) == ([1], 2)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_the_checkpoints_full_forward_agrees_with_the_checks_own(tiny_family, family):
    """Qwen3.5 is a multimodal checkpoint whose decoder sits under `model.language_model`: its first layers load
    alone (every weight checked) and compute what the whole model computes."""
    path = tiny_family(family)
    ids = probe()
    truth = reference_states(reference_model(path), torch.tensor(ids), CAPTURED)
    comparison = compare_with_reference(str(path), CAPTURED, NUM_LAYERS, torch.float32, truth, ids, budget=100)
    assert comparison.names == tuple(f"{layer} ({kind})" for layer, kind in CAPTURED)
    assert comparison.layers_loaded == NUM_LAYERS and comparison.device == "cpu" and comparison.tokens == len(ids)
    assert max(comparison.errors) <= 1e-5 and comparison.rounding == (0.0,) * len(CAPTURED)
    assert comparison.bounds == (FLOORS[torch.float32],) * len(CAPTURED) and comparison.agrees
    require_agreement(comparison, "engine")
    assert "4 layer(s) compared" in comparison.describe()
    partial = compare_with_reference(str(path), CAPTURED, NUM_LAYERS, torch.float32, truth, ids, budget=2)
    assert partial.layers_loaded == 2 and partial.names == ("1 (decoder_output)",) and partial.agrees


@pytest.mark.parametrize(
    ("broken", "layer"),
    [
        (lambda states: torch.roll(states, shifts=-1, dims=0), "1 (decoder_output)"),  # rows one cache slot on
        (lambda states: states[:, [1, 1, 2, 3]], "1 (decoder_output)"),  # layer 3's states for layer 1
        (lambda states: states[:, [0, 1, 2, 2]], f"{NUM_LAYERS - 1} (final_norm)"),  # no final norm applied
    ],
)
def test_states_that_are_not_the_models_are_refused_naming_the_layer(tiny_family, broken, layer):
    path = tiny_family("qwen3")
    ids = probe()
    states = broken(reference_states(reference_model(path), torch.tensor(ids), CAPTURED))
    comparison = compare_with_reference(str(path), CAPTURED, NUM_LAYERS, torch.float32, states, ids, budget=100)
    assert not comparison.agrees
    with pytest.raises(ReferenceMismatch, match=rf"^vLLM extract engine: layer {re.escape(layer)} differs from the checkpoint's "
                                                r"own forward by relative error \d\.\d\de[-+]\d\d, more than float32 "
                                                r"rounding explains") as refused:
        require_agreement(comparison, "vLLM extract engine")
    assert isinstance(refused.value, UnsupportedArchitecture)  # the worker refuses to start, as for any such model


def test_bfloat16_states_are_held_to_what_bfloat16_rounding_explains(tiny_family):
    """The checkpoint's own class in bfloat16 passes (it is what the dtype's rounding gives); a state off by one
    token in bfloat16 does not."""
    path = tiny_family("qwen3")
    ids = probe(60)
    captured = CAPTURED[:2]
    own = reference_states(reference_model(path, dtype=torch.bfloat16), torch.tensor(ids), captured)
    comparison = compare_with_reference(str(path), captured, NUM_LAYERS, torch.bfloat16, own, ids, budget=4)
    assert all(0 < rounding < 0.1 for rounding in comparison.rounding)
    assert comparison.bounds == tuple(max(ROUNDING_FACTOR * r, FLOORS[torch.bfloat16]) for r in comparison.rounding)
    assert comparison.agrees and max(comparison.errors) <= max(comparison.rounding) * 1.5
    shifted = torch.roll(own, shifts=1, dims=0)
    off = compare_with_reference(str(path), captured, NUM_LAYERS, torch.bfloat16, shifted, ids, budget=4)
    assert min(off.errors) > 0.5 > max(off.bounds)
    with pytest.raises(ReferenceMismatch, match="more than bfloat16 rounding explains"):
        require_agreement(off, "vLLM extract engine")


def test_the_bytes_a_spare_device_needs_are_those_of_the_loaded_layers(tiny_family):
    path = tiny_family("qwen3")
    model = reference_model(path)
    per_layer = sum(p.numel() for p in model.model.layers[0].parameters()) * 4
    assert float32_bytes(str(path), 2) - float32_bytes(str(path), 1) == per_layer
    assert float32_bytes(str(path), NUM_LAYERS) == sum(p.numel() for p in model.parameters()) * 4
