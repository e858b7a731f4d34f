"""The checkpoint's own forward streamed one decoder layer at a time (engines/reference/streamed.py) against the same
class loaded whole and run on each sequence alone (dfq_testing.references: another code path, the whole model and
`output_hidden_states`): every family, every kind of entry, a batch of sequences of different lengths, and the
trained checkpoint; one layer's weights resident at a time; a layer without weights refused."""

from __future__ import annotations

import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_queue.engines.reference import streamed as streamed_reference
from dflash_queue.engines.reference.streamed import StreamedDecoder
from dflash_queue.errors import UnsupportedArchitecture
from dfq_testing.families import FAMILIES, NUM_LAYERS
from dfq_testing.references import reference_model, reference_states

LENGTHS = (40, 97, 13)


def sequences(lengths=LENGTHS, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000) for _ in range(length)] for length in lengths]


def captured(num_layers: int) -> list[tuple[int, str]]:
    return [(0, "decoder_output"), (num_layers // 2, "decoder_output"), (num_layers - 2, "decoder_output"),
            (num_layers - 1, "last_layer"), (num_layers - 1, "final_norm")]


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


@pytest.mark.parametrize("family", [name for name, spec in FAMILIES.items() if spec.final_norm])
def test_every_family_streamed_in_a_batch_is_its_own_class_run_alone(tiny_family, family):
    path = tiny_family(family)
    decoder = StreamedDecoder(str(path))
    entries = captured(decoder.num_layers)
    ids = sequences()
    run = decoder.run(ids, entries, torch.float32)
    assert run.tokens == sum(LENGTHS) and run.load_seconds <= run.seconds
    model = reference_model(path, attention=decoder.attention)
    for sequence, got in zip(ids, run.states):
        want = reference_states(model, torch.tensor(sequence), entries)
        assert got.shape == (len(sequence), len(entries), decoder.hidden_size) and got.dtype == torch.float32
        assert float(want.abs().amax(dim=(0, 2)).min()) > 1.0  # large states: a wrong answer shows
        per_entry = [relative(got[:, k], want[:, k]) for k in range(len(entries))]
        assert max(per_entry) <= 1e-5, (family, per_entry)


def test_one_decoder_layer_is_resident_at_a_time(tiny_family, monkeypatch):
    decoder = StreamedDecoder(str(tiny_family("qwen3_5")))
    resident: list[int] = []
    load = streamed_reference._LayerLoader.load

    def counting(self, index, module):
        load(self, index, module)
        layers = self.model.layers
        resident.append(sum(any(not p.is_meta for p in layer.parameters()) for layer in layers))

    monkeypatch.setattr(streamed_reference._LayerLoader, "load", counting)
    decoder.run(sequences(), captured(NUM_LAYERS), torch.float32)
    assert resident == [1] * NUM_LAYERS
    per_layer = sum(p.numel() for p in reference_model(tiny_family("qwen3_5")).model.language_model.layers[0].parameters())
    assert decoder.layer_bytes() >= 4 * per_layer and decoder.layer_bytes(torch.bfloat16) == decoder.layer_bytes() // 2


def test_the_trained_checkpoint_streamed_is_its_own_class_and_bfloat16_rounds_it_by_percents(trained_model):
    """SmolLM2-135M-Instruct (30 layers): the truth in float32 on trained weights, and what bfloat16 does to it."""
    decoder = StreamedDecoder(str(trained_model))
    entries = [(1, "decoder_output"), (14, "decoder_output"), (27, "decoder_output"), (29, "last_layer"),
               (29, "final_norm")]
    ids = sequences((64, 150), seed=3)
    truth = decoder.run(ids, entries, torch.float32).states
    own = decoder.run(ids, entries, torch.bfloat16).states
    model = reference_model(trained_model)
    for sequence, got, rounded in zip(ids, truth, own):
        want = reference_states(model, torch.tensor(sequence), entries)
        assert max(relative(got[:, k], want[:, k]) for k in range(len(entries))) <= 1e-5
        rounding = [relative(rounded[:, k], want[:, k]) for k in range(len(entries))]
        assert all(1e-4 < r < 0.1 for r in rounding), rounding


def test_a_decoder_layer_without_its_weights_is_refused_naming_it(tiny_family, tmp_path):
    source = tiny_family("qwen3")
    broken = tmp_path / "broken"
    shutil.copytree(source, broken)
    (broken / "model.safetensors.index.json").unlink(missing_ok=True)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.layers.3.mlp.down_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    decoder = StreamedDecoder(str(broken))
    with pytest.raises(UnsupportedArchitecture, match=r"decoder layer 3 loads with 1 weights missing \(layers\.3\.mlp"):
        decoder.run(sequences(), captured(NUM_LAYERS), torch.float32)
    del tensors["model.layers.4.input_layernorm.weight"]
    for key in [k for k in tensors if k.startswith("model.layers.5.")]:
        del tensors[key]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UnsupportedArchitecture, match=r"no weights for decoder layer\(s\) \[5\]"):
        StreamedDecoder(str(broken))
