"""The target this project was built for, in miniature: a hybrid linear-attention Qwen3.5 shipped as a multimodal
checkpoint (`Qwen3_5ForConditionalGeneration`), through `dflash-queue run` with real workers, bfloat16 storage and
the final-norm state; every stored state checked against the checkpoint's own forward pass."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen3_5ForConditionalGeneration

from dflash_queue.training import ShardDataset
from dfq_testing.commands import dflash_queue
from dfq_testing.configs import tiny_config_tables, write_config
from dfq_testing.pipeline_shards import FLAG_EVERYTHING
from dfq_testing.references import reference_states

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def test_a_hybrid_multimodal_checkpoint_runs_end_to_end(tiny_family, tmp_path):
    model_path = tiny_family("qwen3_5")
    tables = tiny_config_tables(model_path, tmp_path / "unused", "", tmp_path / "state")
    config_path = write_config(
        tmp_path / "run.toml",
        tables,
        model={"path": str(model_path), "name": "qwen3.5-tiny", "dtype": "float32", "device": "cpu"},
        dataset={"shard_size": 6, "thinking": "never"},
        extract={"num_draft_layers": 3, "token_budget": 192, "hidden_dtype": "bfloat16", "last_layer_state": True,
                 "final_norm_state": True},
        **{"generate.sampling": {"max_tokens": 16}},
        quality=FLAG_EVERYTHING,
    )
    dataset_file = tmp_path / "prompts.jsonl"
    dataset_file.write_text("\n".join((REPO / "examples" / "sharegpt_sample.jsonl").read_text().splitlines()[:12]) + "\n")
    out = tmp_path / "out"
    run = subprocess.run(
        [sys.executable, "-m", "dflash_queue", "run", str(dataset_file), "-c", str(config_path), "-o", str(out)],
        capture_output=True, text=True, timeout=900,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert "shards:            2 done, 0 failed" in run.stdout
    assert "canary:            2 samples rerun alone, worst relative error" in run.stdout
    worker_log = (tmp_path / "state" / "logs" / "extract.log").read_text()
    assert "extraction for qwen3_5_text: packed sequences (per-sequence attention, linear attention per sequence)" \
        in worker_log

    dataset = ShardDataset(out, finish_reasons={"stop", "length"})
    assert len(dataset) == 12
    meta = dataset.shards[0].metadata
    # DFlash rule for 6 layers, K = 3; then the last layer before and after the final norm.
    assert json.loads(meta["layer_ids"]) == [1, 2, 3, 5, 5]
    assert json.loads(meta["layer_states"]) == ["decoder_output"] * 3 + ["last_layer", "final_norm"]
    assert meta["extraction"] == "packed" and json.loads(meta["canary"])["relative_error"] <= 1e-4

    reference = Qwen3_5ForConditionalGeneration.from_pretrained(model_path, dtype=torch.float32).eval()
    captured = list(zip(json.loads(meta["layer_ids"]), json.loads(meta["layer_states"])))
    for number in range(len(dataset)):
        item = dataset[number]
        want = reference_states(reference, item["input_ids"], captured)
        scale = float(want.abs().max())
        torch.testing.assert_close(item["hidden_states"].float(), want, rtol=2**-7, atol=1e-5 * scale)

    exported = dflash_queue("export", out, "--format", "speculators", tmp_path / "hs")
    assert exported.returncode == 0, exported.stderr[-4000:]
    manifest = json.loads((tmp_path / "hs" / "export.json").read_text())
    # vLLM's aux ids of the three layers; each file ends with the last layer before the norm (aux layer 6), which
    # speculators normalises with the verifier's own norm.
    assert manifest["target_layer_ids"] == [2, 3, 4] and manifest["trainer"]["verifier_last_layer"] == 6
    assert manifest["file_entries"] == ["decoder_output"] * 3 + ["last_layer"]
    assert (tmp_path / "hs" / "dataset_info.json").is_file() and (tmp_path / "hs" / "hidden_states").is_dir()
