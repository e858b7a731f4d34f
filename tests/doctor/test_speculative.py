"""doctor on the generate lane's speculative decoding: MTP needs the target's own MTP layers, declared in its config
and present in its weights; a draft model must be named and exist; n-gram needs nothing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors import safe_open
from transformers import AutoConfig

from dflash_queue.doctor.preflight import run_doctor
from dflash_queue.doctor.speculative import check_speculative, declared_mtp_layers, mtp_weights

pytestmark = pytest.mark.vllm  # engine_args are checked against the installed vLLM

MTP = {"method": "mtp", "num_speculative_tokens": 2}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


def checkpoint_with(tiny_model: Path, out: Path, *, mtp_layers: int = 0, extra_keys: tuple[str, ...] = ()) -> Path:
    """The tiny checkpoint, its config declaring `mtp_layers` MTP layers and its weight index listing `extra_keys`
    besides its own tensors."""
    shutil.copytree(tiny_model, out)
    config = json.loads((out / "config.json").read_text())
    if mtp_layers:
        config["num_nextn_predict_layers"] = mtp_layers
    (out / "config.json").write_text(json.dumps(config))
    with safe_open(str(out / "model.safetensors"), framework="pt") as handle:
        keys = list(handle.keys())
    weight_map = {key: "model.safetensors" for key in [*keys, *extra_keys]}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def speculative_check(make_config, model: Path, spec: dict):
    config = make_config(
        generate={"engine": "vllm"},
        model={"path": str(model), "name": "tiny", "dtype": "float32", "device": "cpu"},
        **{"generate.vllm.engine_args": {"speculative_config": spec}},
    )
    return config, check_speculative(config.generate, config.model, AutoConfig.from_pretrained(model))


def test_mtp_on_a_checkpoint_without_mtp_layers_fails_saying_so(make_config, tiny_model):
    config, check = speculative_check(make_config, tiny_model, MTP)
    assert check.verdict == "fail"
    assert "runs the target's own multi-token-prediction layers" in check.detail and "declares none" in check.detail
    # run_doctor says it too.
    checks = {c.name: c for c in run_doctor(config, gpu_reader=lambda: ([], [], None))}
    assert checks["speculative decoding"].verdict == "fail"


def test_mtp_declared_but_missing_from_the_weights_fails(make_config, tiny_model, tmp_path):
    declared_only = checkpoint_with(tiny_model, tmp_path / "declared", mtp_layers=1)
    _, check = speculative_check(make_config, declared_only, MTP)
    assert check.verdict == "fail" and "declares 1 MTP layer(s) but its weights hold none" in check.detail


@pytest.mark.parametrize("keys", [("mtp.fc.weight", "mtp.layers.0.mlp.down_proj.weight"),
                                  ("model.layers.{n}.eh_proj.weight", "model.layers.{n}.enorm.weight")])
def test_mtp_with_its_layers_in_the_checkpoint_passes(make_config, tiny_model, tmp_path, keys):
    # Qwen3.5 / Qwen3-Next name them mtp.*; DeepSeek-V3 and GLM-4.5 store them as the layers after the last one.
    layers = AutoConfig.from_pretrained(tiny_model).num_hidden_layers
    extra = tuple(key.format(n=layers) for key in keys)
    shipped = checkpoint_with(tiny_model, tmp_path / "shipped", mtp_layers=1, extra_keys=extra)
    _, check = speculative_check(make_config, shipped, MTP)
    assert check.verdict == "pass", check.detail
    assert check.detail == "method 'mtp': 1 MTP layer(s) in the checkpoint (2 tensors), 2 token(s) a step"


def test_mtp_layers_are_found_by_name_or_past_the_last_layer_and_not_in_an_encoder():
    keys = ["model.layers.0.mlp.up_proj.weight", "model.layers.1.self_attn.q_proj.weight", "mtp.fc.weight",
            "model.layers.2.eh_proj.weight", "model.visual.blocks.0.attn.qkv.weight",
            "model.vision_tower.encoder.layers.7.mlp.fc1.weight", "model.mtp_layers.0.input_layernorm.weight"]
    assert mtp_weights(keys, 2) == ["mtp.fc.weight", "model.layers.2.eh_proj.weight",
                                    "model.mtp_layers.0.input_layernorm.weight"]
    qwen3_5 = AutoConfig.from_pretrained(Path(__file__).resolve().parents[2] / "examples" / "qwen3.6-27b-class")
    assert declared_mtp_layers(qwen3_5) == 1  # text_config.mtp_num_hidden_layers


def test_ngram_needs_no_weights_and_a_draft_model_must_be_named(make_config, tiny_model, tmp_path):
    _, ngram = speculative_check(make_config, tiny_model, NGRAM)
    assert ngram.verdict == "pass" and "no weights" in ngram.detail
    _, unnamed = speculative_check(make_config, tiny_model, {"method": "eagle3", "num_speculative_tokens": 3})
    assert unnamed.verdict == "fail" and "set speculative_config.model" in unnamed.detail
    missing = {"method": "eagle3", "model": str(tmp_path / "no-drafter"), "num_speculative_tokens": 3}
    _, absent = speculative_check(make_config, tiny_model, missing)
    assert absent.verdict == "fail" and "does not exist" in absent.detail


def test_no_check_without_speculative_decoding(make_config, tiny_model):
    config = make_config(generate={"engine": "vllm"})
    assert check_speculative(config.generate, config.model, AutoConfig.from_pretrained(tiny_model)) is None
    assert "speculative decoding" not in {c.name for c in run_doctor(config, gpu_reader=lambda: ([], [], None))}
