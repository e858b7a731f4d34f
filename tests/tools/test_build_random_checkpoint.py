"""The random-checkpoint builder of tools/gpu_check.sh, at a tiny width on the CPU: the shape it is given, cut to
few layers, loadable by the extract engine, reused when asked again."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoTokenizer

from dflash_queue.engines.base import ExtractionRequest
from dflash_queue.engines.hf.extract import HiddenStateExtractor

REPO = Path(__file__).resolve().parent.parent.parent
EXAMPLE = REPO / "examples" / "qwen3.6-27b-class" / "config.json"
# The example's structure at a width the CPU runs in a moment.
TINY_HYBRID = [
    "text_config.hidden_size=64", "text_config.intermediate_size=128", "text_config.num_attention_heads=2",
    "text_config.num_key_value_heads=1", "text_config.head_dim=32", "text_config.linear_num_key_heads=2",
    "text_config.linear_num_value_heads=4", "text_config.linear_key_head_dim=32",
    "text_config.linear_value_head_dim=32", "vision_config.depth=1", "vision_config.hidden_size=32",
    "vision_config.intermediate_size=64", "vision_config.num_heads=2", "vision_config.out_hidden_size=64",
]
TINY_DENSE = ["hidden_size=64", "intermediate_size=128", "num_attention_heads=2", "num_key_value_heads=1",
              "head_dim=32"]


def load_tool():
    path = REPO / "tools" / "build_random_checkpoint.py"
    spec = importlib.util.spec_from_file_location("build_random_checkpoint", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(tool, out: Path, tokenizer: Path, like: str, settings: list[str], *extra: str) -> Path:
    argv = ["--like", like, "--out", str(out), "--device", "cpu", "--dtype", "float32", "--vocab-size", "1536",
            "--tokenizer", str(tokenizer), *extra]
    for setting in settings:
        argv += ["--set", setting]
    assert tool.main(argv) == 0
    return out


def weights(path: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            tensors.update({key: handle.get_tensor(key) for key in handle.keys()})
    return tensors


def layer_numbers(tensors: dict[str, torch.Tensor], prefix: str) -> set[int]:
    return {int(key[len(prefix):].split(".")[0]) for key in tensors if key.startswith(prefix)}


def extract(path: Path, layer_ids: list[int]) -> list[torch.Tensor]:
    engine = HiddenStateExtractor(str(path), layer_ids=layer_ids, device="cpu", dtype="float32")
    try:
        assert engine.mode == "packed"
        return engine.extract([ExtractionRequest("a", list(range(3, 43))), ExtractionRequest("b", list(range(9, 30)))])
    finally:
        engine.close()


def test_the_example_hybrid_shape_cut_to_four_layers(tiny_model, tmp_path):
    out = build(load_tool(), tmp_path / "hybrid", tiny_model, str(EXAMPLE), TINY_HYBRID, "--layers", "4")
    example = json.loads(EXAMPLE.read_text())
    config = json.loads((out / "config.json").read_text())
    text = config["text_config"]
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    # The first four layers of the 3:1 pattern; the rest of the shape is the example's.
    assert text["num_hidden_layers"] == 4
    assert text["layer_types"] == example["text_config"]["layer_types"][:4] == ["linear_attention"] * 3 + [
        "full_attention"]
    for key in ("partial_rotary_factor", "linear_conv_kernel_dim", "rms_norm_eps", "max_position_embeddings"):
        assert text[key] == example["text_config"][key], key
    assert text["rope_parameters"]["rope_theta"] == example["text_config"]["rope_parameters"]["rope_theta"]
    assert config["image_token_id"] == example["image_token_id"]
    assert (text["hidden_size"], text["vocab_size"], config["vision_config"]["depth"]) == (64, 1536, 1)

    tensors = weights(out)
    assert layer_numbers(tensors, "model.language_model.layers.") == {0, 1, 2, 3}
    assert layer_numbers(tensors, "model.visual.blocks.") == {0}
    assert tensors["model.language_model.embed_tokens.weight"].shape == (1536, 64)
    assert all(t.dtype == torch.float32 for t in tensors.values())
    assert len(AutoTokenizer.from_pretrained(out)) == 1536

    states = extract(out, [0, 3])
    assert [s.shape for s in states] == [(40, 2, 64), (21, 2, 64)]
    assert all(torch.isfinite(s).all() and s.abs().amax() > 0 for s in states)
    assert not torch.allclose(states[0][:, 0], states[0][:, 1])  # two layers, two states


def test_the_text_model_alone_of_a_multimodal_shape(tiny_model, tmp_path):
    out = build(load_tool(), tmp_path / "text", tiny_model, str(EXAMPLE), TINY_HYBRID, "--layers", "4",
                "--text-only")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForCausalLM"] and config["model_type"] == "qwen3_5_text"
    assert config["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert not any("visual" in key for key in weights(out))
    assert extract(out, [3])[0].shape == (40, 1, 64)


def test_a_named_dense_shape_and_reuse(tiny_model, tmp_path, capsys):
    tool = load_tool()
    out = build(tool, tmp_path / "dense", tiny_model, "qwen3-32b", TINY_DENSE, "--layers", "3")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_key_value_heads"]) == (3, 64, 1)
    assert config["rope_parameters"]["rope_theta"] == 1000000.0 and config["tie_word_embeddings"] is False
    first = weights(out)
    assert layer_numbers(first, "model.layers.") == {0, 1, 2} and "lm_head.weight" in first
    assert first["model.layers.0.self_attn.k_proj.weight"].shape == (32, 64)  # 1 kv head x 32
    capsys.readouterr()

    # The same parameters: the build is reused as it is.
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    build(tool, out, tiny_model, "qwen3-32b", TINY_DENSE, "--layers", "3")
    assert re.search(r"^reused ", capsys.readouterr().out, re.M)
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    # Another seed: built again, with other weights.
    build(tool, out, tiny_model, "qwen3-32b", TINY_DENSE, "--layers", "3", "--seed", "1")
    assert re.search(r"^built ", capsys.readouterr().out, re.M)
    again = weights(out)
    assert not torch.equal(again["model.layers.0.mlp.up_proj.weight"], first["model.layers.0.mlp.up_proj.weight"])
    assert not (tmp_path / "dense.tmp").exists()
