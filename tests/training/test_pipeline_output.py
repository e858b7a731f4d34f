"""From a dataset to a training loop and a peer's format: `dflash-queue run` with fp8 storage and real workers,
then the shards read by a DataLoader with two workers, exported and inspected with the CLI."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from dflash_queue.shards.completions import decode_completions
from dflash_queue.shards.keys import completions_key, shard_id_of
from dflash_queue.storage import LocalStorage
from dflash_queue.training import ShardDataset, collate_padded
from dfq_testing.commands import dflash_queue
from dfq_testing.configs import tiny_config_tables, write_config
from dfq_testing.pipeline_shards import FLAG_EVERYTHING

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def cli(*args: str) -> subprocess.CompletedProcess:
    return dflash_queue(*args)


def test_run_with_fp8_then_train_export_and_inspect(tiny_model, tmp_path):
    tables = tiny_config_tables(tiny_model, tmp_path / "unused", "", tmp_path / "state")
    config_path = write_config(
        tmp_path / "run.toml",
        tables,
        extract={"num_draft_layers": 3, "token_budget": 2048, "hidden_dtype": "fp8_e4m3"},
        quality=FLAG_EVERYTHING,
    )
    dataset_file = tmp_path / "prompts.jsonl"
    dataset_file.write_text("\n".join((REPO / "examples" / "sharegpt_sample.jsonl").read_text().splitlines()[:16]) + "\n")
    out = tmp_path / "out"
    run = cli("run", str(dataset_file), "-c", str(config_path), "-o", str(out))
    assert run.returncode == 0, run.stderr[-4000:]
    assert "shards:            2 done, 0 failed" in run.stdout

    dataset = ShardDataset(out, finish_reasons={"stop", "length"})
    assert len(dataset) == 16 and dataset.shards[0].dtype == "fp8_e4m3"
    storage = LocalStorage(out)
    generated = {
        record.id: record.prompt_ids + record.completion_ids
        for key in dataset.keys
        for record in decode_completions(storage.read_bytes(completions_key(shard_id_of(key))), what=key)
    }
    loader = DataLoader(dataset, batch_size=4, shuffle=True, num_workers=2, collate_fn=collate_padded)
    seen = set()
    for batch in loader:
        assert batch["hidden_states"].dtype == torch.bfloat16 and batch["hidden_states"].shape[2:] == (3, 128)
        for row, sample_id in enumerate(batch["sample_id"]):
            length = int(batch["lengths"][row])
            assert batch["input_ids"][row, :length].tolist() == generated[sample_id]
            assert torch.isfinite(batch["hidden_states"][row, :length].float()).all()
            seen.add(sample_id)
    assert seen == set(generated)

    exported = cli("export", str(out), "--format", "specforge", str(tmp_path / "sf"))
    assert exported.returncode == 0, exported.stderr[-4000:]
    manifest = json.loads((tmp_path / "sf" / "export.json").read_text())
    assert manifest["num_samples"] + sum(manifest["left_out"].values()) == 16
    assert manifest["dflash_config.target_layer_ids"] == [1, 2, 3]
    for line in (tmp_path / "sf" / "index.jsonl").read_text().splitlines():
        row = json.loads(line)
        saved = torch.load(tmp_path / "sf" / row["file"], weights_only=True)
        assert saved["input_ids"].tolist() == generated[row["sample_id"]]

    shard = out / dataset.keys[0]
    inspected = cli("inspect", str(shard), "-c", str(config_path), "--deep", "--json")
    assert inspected.returncode == 0, inspected.stderr[-4000:]
    report = json.loads(inspected.stdout)
    assert report["ok"] and report["dtype"] == "fp8_e4m3" and report["samples"] == 8
    assert report["preview"]["first_text"].startswith("<|im_start|>")
