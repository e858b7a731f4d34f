"""Exports of real pipeline shards, read back with plain torch.load / safetensors and compared tensor by tensor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from dflash_queue.exports import FORMATS, LayerConventionError, convert_layer_ids, export_dataset
from dflash_queue.shards.training import TrainingShard
from dflash_queue.storage import LocalStorage
from dflash_queue.training import ShardDataset


def export(root, format_name: str, out: Path, **dataset_options):
    dataset = ShardDataset(root, **dataset_options)
    report = export_dataset(dataset, FORMATS[format_name], LocalStorage(out), source=str(root))
    manifest = json.loads((out / "export.json").read_text())
    index = [json.loads(line) for line in (out / "index.jsonl").read_text().splitlines()]
    return dataset, report, manifest, index


def originals(root) -> dict[str, object]:
    """Every sample as the safetensors library reads it, by id: the independent side of the comparison."""
    return {s.id: s for p in sorted(Path(root, "shards").glob("*.safetensors")) for s in TrainingShard(p)}


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8_e4m3"])
def test_specforge_files_hold_the_shard_tensors_unchanged(pipeline_shards, tmp_path, dtype):
    root = pipeline_shards[dtype].storage.url
    dataset, report, manifest, index = export(root, "specforge", tmp_path / "out")
    truth = originals(root)
    assert report.samples == len(index) == 12 and report.tokens == dataset.num_tokens
    assert manifest["layer_ids"] == manifest["dflash_config.target_layer_ids"] == [1, 2, 3]
    assert manifest["layer_convention"] == "decoder_layer_output" and manifest["hidden_size"] == 128
    assert [row["file"] for row in index] == [f"data_{i:08d}.ckpt" for i in range(12)]
    for row in index:
        saved = torch.load(tmp_path / "out" / row["file"], weights_only=True)
        assert set(saved) == {"input_ids", "loss_mask", "hidden_states"}
        original = truth[row["sample_id"]]
        tokens = original.input_ids.shape[0]
        assert saved["input_ids"].dtype == saved["loss_mask"].dtype == torch.int64
        assert torch.equal(saved["input_ids"], original.input_ids.long())
        assert torch.equal(saved["loss_mask"], original.loss_mask.long())
        assert saved["hidden_states"].dtype == torch.bfloat16 and saved["hidden_states"].shape == (tokens, 3 * 128)
        layers = original.hidden_states.to(torch.bfloat16)  # fp8 shards: the dequantised states
        assert torch.equal(saved["hidden_states"], torch.cat([layers[:, k] for k in range(3)], dim=-1))
        assert row["num_tokens"] == tokens and row["finish_reason"] == original.finish_reason


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8_e4m3"])
def test_speculators_files_hold_the_shard_tensors_unchanged(pipeline_shards, tmp_path, dtype):
    root = pipeline_shards[dtype].storage.url
    _, report, manifest, index = export(root, "speculators", tmp_path / "out")
    truth = originals(root)
    assert manifest["eagle_aux_hidden_state_layer_ids"] == manifest["layer_ids"] == [2, 3, 4]
    assert manifest["source_layer_ids"] == [1, 2, 3] and manifest["layer_convention"] == "hf_hidden_states_index"
    assert manifest["layer_states"] == ["decoder_output"] * 3
    # The last entry is decoder layer 3 before any norm, not the final hidden state speculators takes it for.
    [note] = [note for note in report.notes if "final hidden state" in note]
    assert "decoder layer 3 of 6 before any norm" in note and "extract.final_norm_state = true" in note
    assert [row["file"] for row in index] == [f"hs_{i}.safetensors" for i in range(12)]
    for row in index:
        path = tmp_path / "out" / row["file"]
        saved = load_file(str(path))
        with safe_open(str(path), "pt") as handle:
            metadata = handle.metadata()
        original = truth[row["sample_id"]]
        assert set(saved) == {"token_ids", "hidden_states", "loss_mask"}
        assert torch.equal(saved["token_ids"], original.input_ids.long())
        assert torch.equal(saved["loss_mask"], original.loss_mask.long())
        assert torch.equal(saved["hidden_states"], original.hidden_states.to(torch.bfloat16))
        assert metadata["sample_id"] == row["sample_id"] and json.loads(metadata["layer_ids"]) == [2, 3, 4]


def test_exported_layer_ids_select_what_each_trainer_means(pipeline_shards, tiny_model, tmp_path):
    """SpecForge takes hidden_states[layer_id + 1] for each target_layer_id; vLLM/speculators take
    hidden_states[layer_id]. An independent forward pass shows the exported ids point at the exported states."""
    root = pipeline_shards["float32"].storage.url
    export(root, "specforge", tmp_path / "sf", hidden_dtype=torch.float32)
    export(root, "speculators", tmp_path / "sp", hidden_dtype=torch.float32)
    sf_manifest = json.loads((tmp_path / "sf" / "export.json").read_text())
    sp_manifest = json.loads((tmp_path / "sp" / "export.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    for number in (0, 7):
        specforge = torch.load(tmp_path / "sf" / f"data_{number:08d}.ckpt", weights_only=True)
        speculators = load_file(str(tmp_path / "sp" / f"hs_{number}.safetensors"))
        with torch.inference_mode():
            hf = model(specforge["input_ids"][None], output_hidden_states=True).hidden_states
        sf_expected = torch.cat([hf[i + 1][0] for i in sf_manifest["dflash_config.target_layer_ids"]], dim=-1)
        torch.testing.assert_close(specforge["hidden_states"], sf_expected, rtol=1e-4, atol=1e-4)
        sp_expected = torch.stack([hf[i][0] for i in sp_manifest["eagle_aux_hidden_state_layer_ids"]], dim=1)
        torch.testing.assert_close(speculators["hidden_states"], sp_expected, rtol=1e-4, atol=1e-4)


def test_export_keeps_only_the_samples_the_filters_keep(pipeline_shards, tmp_path):
    root = pipeline_shards["bfloat16"].storage.url
    dataset, report, manifest, index = export(root, "specforge", tmp_path / "out", finish_reasons={"stop"})
    assert report.samples == len(dataset) == len(index) < 12
    assert {row["finish_reason"] for row in index} == {"stop"}
    assert manifest["filtered"] == {"finish_reason=length": 12 - len(dataset)}
    assert sorted(p.name for p in (tmp_path / "out").glob("*.ckpt")) == [row["file"] for row in index]


def rewrite_metadata(path: Path, **changes: str) -> None:
    tensors = load_file(str(path))
    with safe_open(str(path), "pt") as handle:
        metadata = {**handle.metadata(), **changes}
    save_file(tensors, str(path), metadata=metadata)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"layer_convention": "decoder_layer_input"}, "layer_convention 'decoder_layer_input' is not one this exporter knows"),
        ({"hf_hidden_states_index": "layer_id"}, "hf_hidden_states_index 'layer_id' contradicts"),
        ({"num_model_layers": "3"}, r"layer ids \[3\] outside a model of 3 layers"),
    ],
)
def test_layer_ids_of_unknown_or_inconsistent_meaning_are_not_converted(pipeline_shards, tmp_path, changes, message):
    root = tmp_path / "run"
    shutil.copytree(pipeline_shards["bfloat16"].storage.url, root)
    for path in sorted((root / "shards").glob("*.safetensors")):
        rewrite_metadata(path, **changes)
    with pytest.raises(LayerConventionError, match=message) as raised:
        export(root, "speculators", tmp_path / "out")
    assert "shards/" in str(raised.value) and not list((tmp_path / "out").glob("hs_*"))


def test_layer_id_conversion():
    assert convert_layer_ids([1, 9, 17], "decoder_layer_output", "hf_hidden_states_index") == [2, 10, 18]
    assert convert_layer_ids([2, 10], "hf_hidden_states_index", "decoder_layer_output") == [1, 9]
    assert convert_layer_ids([4], "decoder_layer_output", "decoder_layer_output") == [4]
    with pytest.raises(LayerConventionError, match="unknown layer convention 'vllm'"):
        convert_layer_ids([1], "vllm", "decoder_layer_output")
