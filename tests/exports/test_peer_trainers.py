"""Every export read by its trainer's own released code (speculators 0.9 with hs-connectors, SpecForge 0.2), every
tensor compared with the shards, and the layer semantics checked on a model whose norm weights are not all 1:
speculators' train command (its config resolution, draft build, datasets table, multipack sampler, collator and
EAGLE-3 shift, and a training forward), SpecForge's offline reader, normalizer, feature loader and collator."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from dflash_queue.exports import export_dataset, export_format
from dflash_queue.shards.training import TrainingShard
from dflash_queue.storage import LocalStorage
from dflash_queue.training import ShardDataset
from dfq_testing.peers import run_speculators_train
from dfq_testing.references import reference_model

pytestmark = pytest.mark.slow

CONTEXT = [0, 1, 2]  # the shards' entries: layers 1, 2, 3, then the last layer before the norm, then after it
LAST, FINAL = 3, 4


def export(root: str, name: str, method: str, out: Path) -> tuple[dict, list[dict]]:
    dataset = ShardDataset(root, hidden_dtype=torch.float32)
    export_dataset(dataset, export_format(name, method), LocalStorage(out), source=root)
    manifest = json.loads((out / "export.json").read_text())
    index = [json.loads(line) for line in (out / "index.jsonl").read_text().splitlines()]
    return manifest, index


def shard_samples(root: str) -> dict[str, object]:
    """Every sample as the shard reader gives it, by id: the side the trainers' tensors are compared with."""
    return {s.id: s for p in sorted(Path(root, "shards").glob("*.safetensors")) for s in TrainingShard(p)}


def context_of(sample) -> torch.Tensor:
    states = sample.hidden_states.float()
    return torch.cat([states[:, k] for k in CONTEXT], dim=-1)


# ---------------------------------------------------------------------------------------------------------------
# speculators


@pytest.mark.parametrize("method", ["dflash", "eagle3"])
def test_speculators_train_command_trains_on_the_export_with_every_tensor_from_the_shards(
    method, peer_shards, tiny_family, tmp_path, monkeypatch
):
    root = peer_shards["float32"].storage.url
    manifest, index = export(root, "speculators", method, tmp_path / "export")
    assert manifest["trainer"]["arguments"][:2] == ["--speculator-type", method]
    assert manifest["target_layer_ids"] == [2, 3, 4]  # vLLM's aux ids of layers 1, 2, 3; the last (6) implied
    arguments = [
        "--verifier-name-or-path", str(tiny_family("qwen3")), "--data-path", str(tmp_path / "export"),
        *manifest["trainer"]["arguments"], "--save-path", str(tmp_path / "save"),
    ]
    built = run_speculators_train(arguments, monkeypatch)
    assert math.isfinite(built["loss"])
    # The export's draft vocabulary: every supervised token it counted, mapped from the exported token_freq.pt.
    frequencies = torch.load(tmp_path / "export" / "token_freq.pt", weights_only=True)
    assert manifest["trainer"]["draft_vocab_size"] == len(frequencies) < built["model"].verifier_vocab_size
    assert built["model"].t2d.nonzero().flatten().tolist() == sorted(frequencies)
    assert (tmp_path / "export" / f"d2t-{len(frequencies)}.npy").is_file()
    samples = shard_samples(root)
    train, val = built["train"].dataset, built["val"].dataset
    assert len(train) + len(val) == len(index) == 12

    # Row by row: the table's row r is file r (train rows first, then the held-out ones).
    model = built["model"]
    for number, item in enumerate([train[i] for i in range(len(train))] + [val[i] for i in range(len(val))]):
        sample = samples[index[number]["sample_id"]]
        states = sample.hidden_states.float()
        assert torch.equal(item["input_ids"], sample.input_ids.long())
        assert torch.equal(item["loss_mask"].long(), sample.loss_mask.long())
        assert torch.equal(item["hidden_states"].float(), context_of(sample))
        assert torch.equal(item["verifier_last_hidden_states"].float(), states[:, LAST])
        # The state speculators normalises with the verifier's own norm is the one before the norm: normalised,
        # it is the model's last hidden state after the norm (the shards' final-norm entry).
        with torch.no_grad():
            normed = model.verifier_norm(item["verifier_last_hidden_states"].float())
        torch.testing.assert_close(normed, states[:, FINAL], rtol=1e-5, atol=1e-5)

    # The first packed batch, through the multipack sampler and collator (and EAGLE-3's shift by one token).
    batch = built["batch"]
    documents = batch["document_ids"][0]
    assert int(documents.max()) >= 1  # several samples packed in one row
    by_ids = {tuple(s.input_ids.tolist()): s for s in samples.values()}
    for document in range(int(documents.max()) + 1):
        rows = documents == document
        ids = batch["input_ids"][0, rows]
        shift = 1 if method == "eagle3" else 0
        sample = next(s for key, s in by_ids.items() if list(key[shift:]) == ids.tolist())
        states = sample.hidden_states.float()
        end = len(sample.input_ids) - shift
        assert torch.equal(batch["hidden_states"][0, rows].float(), context_of(sample)[:end])
        assert torch.equal(batch["verifier_last_hidden_states"][0, rows].float(), states[shift:, LAST])
        assert torch.equal(batch["loss_mask"][0, rows].long(), sample.loss_mask.long()[shift:])


def test_the_speculators_table_is_in_file_order_and_counts_the_supervised_tokens(peer_shards, tmp_path):
    import datasets

    root = peer_shards["bfloat16"].storage.url
    manifest, index = export(root, "speculators", "dflash", tmp_path / "export")
    table = datasets.load_from_disk(str(tmp_path / "export"))
    samples = shard_samples(root)
    assert table.format["type"] == "torch" and set(table.column_names) == {"input_ids", "loss_mask", "seq_len"}
    # A seeded order, not the shards': speculators holds out its last rows for validation.
    assert [row["sample_id"] for row in index] != sorted(samples, key=list(samples).index)
    for number, row in enumerate(index):
        sample = samples[row["sample_id"]]
        assert row["file"] == f"hidden_states/hs_{number}.safetensors"
        assert table[number]["input_ids"].tolist() == sample.input_ids.tolist()
        assert int(table[number]["seq_len"]) == len(sample.input_ids)
    frequencies = torch.load(tmp_path / "export" / "token_freq.pt", weights_only=True)
    supervised = torch.cat([s.input_ids[s.loss_mask.bool()] for s in samples.values()])
    ids, counts = supervised.unique(return_counts=True)
    assert frequencies == dict(zip(ids.tolist(), counts.tolist()))
    again, _ = export(root, "speculators", "dflash", tmp_path / "again")
    assert [json.loads(line)["sample_id"] for line in (tmp_path / "again" / "index.jsonl").read_text().splitlines()] \
        == [row["sample_id"] for row in index]  # the same seed, the same numbering


# ---------------------------------------------------------------------------------------------------------------
# SpecForge


def specforge_batches(out: Path, method: str) -> list[tuple[str, object]]:
    """(file name, batch) for every file, through SpecForge's offline reader, normalizer, loader and collator."""
    from specforge.algorithms.builtin import builtin_algorithm_registry
    from specforge.runtime.data_plane.feature_dataloader import FeatureDataLoader
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore

    provider = builtin_algorithm_registry().resolve(method).providers.offline_for("text")
    refs = provider.build_reader(str(out), run_id="test", ttt_length=7, max_len=2048).read()
    loader = FeatureDataLoader(
        LocalFeatureStore("test"),
        refs=refs,
        batch_size=1,
        collate_fn=provider.build_collator(),
        per_sample_transform=provider.build_normalizer(2048, ttt_length=7, use_usp_preprocess=False),
        strategy=method,
        drop_last=False,
    )
    batches = list(loader)
    assert len(batches) == len(refs)
    return [(Path(ref.feature_store_uri).name, batch) for ref, batch in zip(refs, batches)]


@pytest.mark.parametrize("method", ["dflash", "eagle3"])
def test_specforge_offline_loader_reads_the_export_with_every_tensor_from_the_shards(
    method, peer_shards, tiny_family, tmp_path
):
    root = peer_shards["float32"].storage.url
    manifest, index = export(root, "specforge", method, tmp_path / "export")
    files = {row["file"]: row["sample_id"] for row in index}
    samples = shard_samples(root)
    model = reference_model(tiny_family("qwen3"))
    batches = specforge_batches(tmp_path / "export", method)
    assert [name for name, _ in batches] == [row["file"] for row in index]
    for name, batch in batches:
        sample = samples[files[name]]
        tensors = batch.tensors
        assert torch.equal(tensors["input_ids"][0], sample.input_ids.long())
        if method == "dflash":
            assert manifest["dflash_config.target_layer_ids"] == [1, 2, 3]
            assert torch.equal(tensors["loss_mask"][0], sample.loss_mask.long())
            assert torch.equal(tensors["hidden_states"][0], context_of(sample))
        else:
            assert batch.metadata["target_repr"] == "hidden_state"
            mask = sample.loss_mask.long().clone()
            mask[-1] = 0  # SpecForge's EAGLE-3 normalizer supervises no prediction past the sequence
            assert torch.equal(tensors["loss_mask"][0], mask)
            assert torch.equal(tensors["hidden_state"][0], context_of(sample))
            target = tensors["target"][0]
            assert torch.equal(target, sample.hidden_states.float()[:, FINAL])
            # SpecForge's target head applies only the LM head: to the state after the norm, that is the model's
            # own logits.
            with torch.inference_mode():
                logits = model(input_ids=sample.input_ids[None].long()).logits[0]
                torch.testing.assert_close(model.lm_head(target), logits, rtol=1e-4, atol=1e-4)


def test_specforge_refuses_what_the_dflash_export_leaves_out():
    """A sample without two consecutive supervised tokens stops SpecForge's DFlash reader: the export leaves it
    out, and only it."""
    from specforge.algorithms.builtin import builtin_algorithm_registry

    normalize = builtin_algorithm_registry().resolve("dflash").providers.offline_for("text").build_normalizer(
        2048, ttt_length=7, use_usp_preprocess=False
    )
    dflash = export_format("specforge", "dflash")
    for mask, refused in (([0, 1, 0, 1, 0], True), ([0, 1, 1, 0, 0], False)):
        sample = {"input_ids": torch.arange(5), "loss_mask": torch.tensor(mask), "hidden_states": torch.ones(5, 6)}
        assert (dflash.skip_reason(sample) is not None) == refused
        if refused:
            with pytest.raises(ValueError):
                normalize(sample)
        else:
            normalize(sample)


def test_specforge_derives_the_exported_dflash_layers_from_the_draft_depth():
    """SpecForge builds a DFlash draft's target layers from the target's depth and the draft's (its
    build_target_layer_ids): the same rule as this project's DFlash layers, so `model.draft_num_hidden_layers = K`
    selects what the shards hold."""
    from specforge.modeling.draft.dflash import build_target_layer_ids

    from dflash_queue.engines.layers import dflash_layer_ids

    for layers in (6, 36, 40, 48, 62, 64, 94):
        for k in range(1, 9):
            if k == 1 or layers - 3 >= k:
                assert build_target_layer_ids(layers, k) == dflash_layer_ids(layers, k), (layers, k)
