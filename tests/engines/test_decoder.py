"""Loading the text decoder of text-only and multimodal checkpoints, with every weight accounted for."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    Gemma3ForConditionalGeneration,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3VLForConditionalGeneration,
)

from dflash_queue.engines.decoder import load_text_decoder, read_layout, spread_device_map
from dflash_queue.engines.hf.causal_lm import load_causal_lm
from dflash_queue.errors import UnsupportedArchitecture
from dfq_testing.families import FAMILIES

CPU = torch.device("cpu")
IDS = torch.tensor([[5, 17, 301, 9, 44, 1200, 3, 77]])


@pytest.mark.parametrize(
    ("name", "full_class", "prefix"),
    [
        ("qwen3_5", Qwen3_5ForConditionalGeneration, "model.language_model."),
        ("gemma3", Gemma3ForConditionalGeneration, "language_model.model."),
        # No text-only causal LM class in Transformers: the text decoder under the checkpoint's LM head.
        ("qwen3_vl", Qwen3VLForConditionalGeneration, "model.language_model."),
        ("qwen3_5_moe", Qwen3_5MoeForConditionalGeneration, "model.language_model."),
    ],
)
def test_multimodal_checkpoints_load_their_text_decoder_only(tiny_family, name, full_class, prefix):
    path = tiny_family(name)
    layout = read_layout(str(path))
    assert layout.multimodal and layout.text_prefix == prefix
    decoder = load_text_decoder(str(path), dtype=torch.float32, device=CPU, attn_implementation="sdpa")
    names = [n for n, _ in decoder.named_modules()]
    assert not [n for n in names if "vis" in n], "no vision tower is built"
    assert decoder.config.num_hidden_layers == 6 and decoder.config.hidden_size == 64

    full = full_class.from_pretrained(path, dtype=torch.float32).eval()
    causal = load_causal_lm(str(path), dtype=torch.float32, device=CPU)
    with torch.inference_mode():
        want = full(input_ids=IDS, output_hidden_states=True)
        got = decoder(input_ids=IDS, output_hidden_states=True).hidden_states
        logits = causal(input_ids=IDS).logits
    for mine, theirs in zip(got, want.hidden_states, strict=True):
        torch.testing.assert_close(mine, theirs)
    torch.testing.assert_close(logits, want.logits)
    assert "ForCausalLM" in type(causal).__name__


def test_a_checkpoint_missing_a_weight_is_refused(tiny_family, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_family("qwen3_5"), broken)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.language_model.layers.2.mlp.up_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UnsupportedArchitecture, match=r"1 weights missing .*layers\.2\.mlp\.up_proj\.weight"):
        load_text_decoder(str(broken), dtype=torch.float32, device=CPU, attn_implementation="sdpa")
    with pytest.raises(UnsupportedArchitecture, match="random initialisation"):
        load_causal_lm(str(broken), dtype=torch.float32, device=CPU)


def test_a_multimodal_checkpoint_without_an_lm_head_is_refused_for_generation(tiny_family, tmp_path):
    broken = tmp_path / "headless"
    shutil.copytree(tiny_family("qwen3_vl"), broken)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UnsupportedArchitecture, match=r"qwen3_vl needs one LM head weight \('\*lm_head.weight'; "
                                                       r"found: none\).*generation would run a random head"):
        load_causal_lm(str(broken), dtype=torch.float32, device=CPU)


def test_a_head_transform_the_text_causal_lm_cannot_apply_is_refused(tiny_family, tmp_path):
    import json

    changed = tmp_path / "softcapped"
    shutil.copytree(tiny_family("qwen3_vl"), changed)
    config = json.loads((changed / "config.json").read_text())
    config["text_config"]["final_logit_softcapping"] = 30.0
    (changed / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitecture, match="sets final_logit_softcapping = 30.0, a transform of the head"):
        load_causal_lm(str(changed), dtype=torch.float32, device=CPU)


def test_a_text_only_checkpoint_loads_as_before(tiny_model):
    layout = read_layout(str(tiny_model))
    assert not layout.multimodal and layout.text_prefix is None
    decoder = load_text_decoder(str(tiny_model), dtype=torch.float32, device=CPU, attn_implementation="sdpa")
    assert type(decoder).__name__ == "Qwen3Model"


def placed(name: str, mapping: dict[str, int]) -> bool:
    return any(name == module or name.startswith(f"{module}.") for module in mapping)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_spread_device_map_places_every_weight_and_buffer_of_the_decoder(tiny_family, family, monkeypatch):
    """Every tensor of the decoder has a GPU in the map (a tensor without one would stay on the CPU); loaded here
    through the map with every GPU replaced by the CPU, which is all a machine without GPUs can do."""
    from transformers import AutoModel

    path = str(tiny_family(family))
    layout = read_layout(path)
    mapping = spread_device_map(path, layout, 3)
    assert [mapping[f"layers.{i}"] for i in range(6)] == [0, 0, 1, 1, 2, 2] and mapping["embed_tokens"] == 0
    given: list = []
    from_pretrained = AutoModel.from_pretrained
    monkeypatch.setattr(AutoModel, "from_pretrained", lambda *args, **kwargs: given.append(kwargs.get("device_map"))
                        or from_pretrained(*args, **kwargs))
    on_the_cpu = dict.fromkeys(mapping, "cpu")
    decoder = load_text_decoder(
        path, dtype=torch.float32, device=CPU, attn_implementation="eager", layout=layout, device_map=on_the_cpu
    )
    assert given == [on_the_cpu]  # Transformers places the weights by the map
    tensors = [name for name, _ in (*decoder.named_parameters(), *decoder.named_buffers())]
    assert [name for name in tensors if not placed(name, mapping)] == []
