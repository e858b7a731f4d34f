"""Exports of real pipeline shards, read back with plain torch.load / safetensors and compared tensor by tensor;
what each trainer needs and the refusals when the shards lack it. (The trainers' own loaders read the exports in
test_peer_trainers.py.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from dflash_queue.exports import ExportRefused, LayerConventionError, convert_layer_ids, export_dataset, export_format
from dflash_queue.exports.formats import Speculators, StoredLayers
from dflash_queue.shards.training import TrainingShard
from dflash_queue.storage import LocalStorage
from dflash_queue.training import ShardDataset


def export(root, format_name: str, out: Path, method: str = "dflash", **dataset_options):
    dataset = ShardDataset(root, **dataset_options)
    report = export_dataset(dataset, export_format(format_name, method), LocalStorage(out), source=str(root))
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
    # A sample whose reply is one token has no two consecutive supervised tokens: SpecForge refuses it, so it is
    # left out and counted.
    short = [s.id for s in truth.values() if not (s.loss_mask[1:].bool() & s.loss_mask[:-1].bool()).any()]
    assert report.samples == len(index) == 12 - len(short) and set(row["sample_id"] for row in index).isdisjoint(short)
    assert dict(report.skipped) == ({"fewer than two consecutive supervised tokens (SpecForge's DFlash reader "
                                      "refuses them)": len(short)} if short else {})
    assert report.tokens == sum(len(s.input_ids) for i, s in truth.items() if i not in short)
    assert manifest["layer_ids"] == manifest["dflash_config.target_layer_ids"] == [1, 2, 3]
    assert manifest["layer_convention"] == "decoder_layer_output" and manifest["hidden_size"] == 128
    assert [row["file"] for row in index] == [f"data_{i:08d}.ckpt" for i in range(len(index))]
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


def test_speculators_files_hold_the_layers_then_the_last_layer_before_the_norm(peer_shards, tmp_path):
    root = peer_shards["bfloat16"].storage.url
    _, report, manifest, index = export(root, "speculators", tmp_path / "out")
    truth = originals(root)
    assert manifest["target_layer_ids"] == manifest["layer_ids"] == [2, 3, 4] and report.samples == 12
    assert manifest["layer_convention"] == "vllm_aux_layer" and manifest["trainer"]["verifier_last_layer"] == 6
    assert manifest["file_entries"] == ["decoder_output"] * 3 + ["last_layer"]
    assert manifest["source_layer_ids"] == [1, 2, 3, 5, 5]
    assert manifest["source_layer_states"] == ["decoder_output"] * 3 + ["last_layer", "final_norm"]
    for row in index:
        path = tmp_path / "out" / row["file"]
        saved = load_file(str(path))
        with safe_open(str(path), "pt") as handle:
            metadata = handle.metadata()
        original = truth[row["sample_id"]]
        assert set(saved) == {"token_ids", "hidden_states"}
        assert torch.equal(saved["token_ids"], original.input_ids.long())
        assert torch.equal(saved["hidden_states"], original.hidden_states[:, [0, 1, 2, 3]].to(torch.bfloat16))
        assert metadata["sample_id"] == row["sample_id"] and json.loads(metadata["aux_layer_ids"]) == [2, 3, 4]


def test_the_speculators_arguments_name_the_exported_token_counts_and_a_draft_vocabulary(peer_shards, tmp_path):
    """export.json's arguments, as speculators' own parser reads them: the exported token_freq.pt and a draft
    vocabulary of the distinct supervised tokens (fewer than 32,000 here), or the size asked for."""
    from speculators.train.config.resolution import build_parser

    root = peer_shards["bfloat16"].storage.url
    _, _, manifest, _ = export(root, "speculators", tmp_path / "out")
    frequencies = torch.load(tmp_path / "out" / "token_freq.pt", weights_only=True)
    supervised = {int(t) for s in originals(root).values() for t in s.input_ids[s.loss_mask.bool()]}
    assert set(frequencies) == supervised and 1 < len(supervised) < 32_000
    trainer = manifest["trainer"]
    parsed = build_parser().parse_args(["--verifier-name-or-path", "verifier", "--data-path", str(tmp_path / "out"),
                                        *trainer["arguments"]])
    assert parsed.token_freq_path == trainer["token_freq_path"] == str(tmp_path / "out" / "token_freq.pt")
    assert parsed.draft_vocab_size == trainer["draft_vocab_size"] == len(supervised)
    assert parsed.speculator_type == "dflash" and parsed.target_layer_ids == [2, 3, 4] and parsed.on_missing == "raise"

    dataset = ShardDataset(root)
    export_dataset(dataset, export_format("speculators", "eagle3", draft_vocab_size=50), LocalStorage(tmp_path / "b"),
                   source=root)
    asked = json.loads((tmp_path / "b" / "export.json").read_text())["trainer"]
    assert build_parser().parse_args(["--verifier-name-or-path", "v", *asked["arguments"]]).draft_vocab_size == 50
    # A dataset supervising more distinct tokens than a draft vocabulary holds gets the usual 32,000.
    assert Speculators("dflash").vocabulary_fields("t.pt", 150_000)["draft_vocab_size"] == 32_000
    with pytest.raises(ValueError, match="draft vocabulary size 0"):
        export_format("speculators", draft_vocab_size=0)


def test_exported_layer_ids_select_what_each_trainer_means(peer_shards, tiny_family, tmp_path):
    """SpecForge takes hidden_states[layer_id + 1] for each target layer; speculators (vLLM's aux ids) the
    residual stream before layer id, and last the last layer's output before the norm, which only a hook on the
    last layer sees (Transformers' last hidden_states entry is after the norm). An independent forward pass shows
    each trainer's reading of the exported ids selects exactly the exported states."""

    root = peer_shards["float32"].storage.url
    export(root, "specforge", tmp_path / "sf", hidden_dtype=torch.float32)
    export(root, "speculators", tmp_path / "sp", hidden_dtype=torch.float32)
    sf_manifest = json.loads((tmp_path / "sf" / "export.json").read_text())
    sp_manifest = json.loads((tmp_path / "sp" / "export.json").read_text())
    sp_index = {json.loads(line)["file"]: json.loads(line)["sample_id"]
                for line in (tmp_path / "sp" / "index.jsonl").read_text().splitlines()}
    model = AutoModelForCausalLM.from_pretrained(tiny_family("qwen3"), dtype=torch.float32).eval()
    last: list[torch.Tensor] = []
    model.model.layers[-1].register_forward_hook(lambda _m, _i, out: last.append(out[0] if isinstance(out, tuple) else out))
    for number in (0, 7):
        specforge = torch.load(tmp_path / "sf" / f"data_{number:08d}.ckpt", weights_only=True)
        with torch.inference_mode():
            hf = model(specforge["input_ids"][None], output_hidden_states=True).hidden_states
        sf_expected = torch.cat([hf[i + 1][0] for i in sf_manifest["dflash_config.target_layer_ids"]], dim=-1)
        torch.testing.assert_close(specforge["hidden_states"], sf_expected, rtol=1e-4, atol=1e-4)
    for name in list(sp_index)[:2]:
        speculators = load_file(str(tmp_path / "sp" / name))
        last.clear()
        with torch.inference_mode():
            hf = model(speculators["token_ids"][None], output_hidden_states=True).hidden_states
        aux = [hf[i][0] for i in sp_manifest["target_layer_ids"]]
        assert sp_manifest["trainer"]["verifier_last_layer"] == len(hf) - 1
        sp_expected = torch.stack([*aux, last[0][0]], dim=1)
        torch.testing.assert_close(speculators["hidden_states"], sp_expected, rtol=1e-4, atol=1e-4)
        assert (speculators["hidden_states"][:, -1] - hf[-1][0]).abs().max() > 0.1  # not the post-norm entry


def test_trainers_that_need_a_state_the_shards_lack_are_refused_with_the_setting_named(pipeline_shards, tmp_path):
    """The pipeline shards hold three decoder layers and nothing else: no export writes another layer in the place of
    the one a trainer reads, and nothing is written."""
    root = pipeline_shards["bfloat16"].storage.url
    with pytest.raises(ExportRefused, match=r"must be decoder layer 5's output before the norm \(vLLM's aux layer 6\); "
                                            r"these shards lack it: extract with extract.last_layer_state = true"):
        export(root, "speculators", tmp_path / "sp")
    with pytest.raises(ExportRefused, match=r"after the final norm .* these shards lack it: extract with "
                                            r"extract.final_norm_state = true"):
        export(root, "specforge", tmp_path / "sf", method="eagle3")
    assert not (tmp_path / "sp").exists() and not (tmp_path / "sf").exists()


@pytest.mark.parametrize(
    ("name", "method", "states", "message"),
    [
        ("speculators", "dflash", ["decoder_output"] * 3 + ["final_norm"],
         "their final_norm entry is after the norm: speculators would apply the norm a second time"),
        ("specforge", "eagle3", ["decoder_output"] * 5 + ["final_norm"],
         r"reads exactly 3 target layers .* these shards store 5 .* extract.layer_ids = \[1, 31, 60\]"),
        ("specforge", "dflash", ["last_layer", "final_norm"], "these shards store none"),
    ],
)
def test_each_refusal_says_why_and_what_fixes_it(name, method, states, message):
    layers = StoredLayers(tuple(range(1, len(states) + 1)), tuple(states), 64)
    with pytest.raises(ExportRefused, match=message):
        export_format(name, method).select(layers)


def test_a_context_layer_that_is_the_last_layer_serves_as_speculators_last_state():
    """Shards that store every layer need no separate last-layer entry: layer N - 1 is the state before the norm."""
    layers = StoredLayers((0, 1, 2, 3, 4, 5), ("decoder_output",) * 6, 6)
    selection = export_format("speculators").select(layers)
    assert selection.context == (0, 1, 2, 3, 4, 5) and selection.last == 5
    assert selection.trainer_layer_ids == (1, 2, 3, 4, 5, 6)


def test_export_keeps_only_the_samples_the_filters_keep(pipeline_shards, tmp_path):
    root = pipeline_shards["bfloat16"].storage.url
    dataset, report, manifest, index = export(root, "specforge", tmp_path / "out", finish_reasons={"stop"})
    assert report.samples + sum(report.skipped.values()) == len(dataset) < 12 and report.samples == len(index)
    assert {row["finish_reason"] for row in index} == {"stop"}
    assert manifest["filtered"] == {"finish_reason=length": 12 - len(dataset)}
    assert manifest["left_out"] == dict(report.skipped)
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
    assert convert_layer_ids([1, 63], "decoder_layer_output", "vllm_aux_layer") == [2, 64]
    assert convert_layer_ids([2, 10], "hf_hidden_states_index", "decoder_layer_output") == [1, 9]
    assert convert_layer_ids([4], "decoder_layer_output", "decoder_layer_output") == [4]
    with pytest.raises(LayerConventionError, match="unknown layer convention 'vllm'"):
        convert_layer_ids([1], "vllm", "decoder_layer_output")
