"""`dflash-queue export` and `dflash-queue inspect` as a user runs them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from click.testing import CliRunner
from transformers import AutoTokenizer

from dflash_queue.cli import main
from dflash_queue.shards.training import TrainingShard


def shards_of(config) -> list[Path]:
    return sorted(Path(config.storage.url, "shards").glob("*.safetensors"))


def test_inspect_decodes_the_first_tokens_with_the_tokenizer(pipeline_shards, tiny_model):
    config = pipeline_shards["fp8_e4m3"]
    path = shards_of(config)[1]
    result = CliRunner().invoke(main, ["inspect", str(path), "--tokenizer", str(tiny_model), "--sample", "1", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    sample = TrainingShard(path)[1]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    preview = report["preview"]
    first = sample.input_ids[:32].tolist()
    assert preview["id"] == sample.id and preview["first_ids"] == first
    # The reply's thinking state as the gate found it (what audit counts), beside what the prompt asked for.
    shard = TrainingShard(path)
    assert (preview["thinking_requested"], preview["thinking"]) == (shard.thinking[1], shard.quality[1]["thinking"])
    assert preview["first_text"] == tokenizer.decode(first, skip_special_tokens=False)
    assert preview["first_text"].startswith("<|im_start|>")
    start = int(torch.nonzero(sample.loss_mask)[0])
    assert preview["completion_text"] == tokenizer.decode(sample.input_ids[start : start + 32].tolist())
    assert report["ok"] and report["samples"] == 6 and report["dtype"] == "fp8_e4m3"
    assert report["layer_ids"] == [1, 2, 3] and report["metadata"]["target_model"] == "tiny-qwen3"
    assert {c["name"]: c["status"] for c in report["checks"]}["checksum"] == "no record"

    text = CliRunner().invoke(main, ["inspect", str(path), "-c", config.source])
    assert text.exit_code == 0, text.output
    assert "first tokens: '<|im_start|>" in text.output and "fp8_e4m3" in text.output
    assert "completion starts at token" in text.output
    assert f"thinking requested {shard.thinking[0]} (in the reply: {shard.quality[0]['thinking']})" in text.output


def test_inspect_fails_on_a_damaged_shard(pipeline_shards, tmp_path):
    path = tmp_path / "cut.safetensors"
    path.write_bytes(shards_of(pipeline_shards["bfloat16"])[0].read_bytes()[:-10])
    result = CliRunner().invoke(main, ["inspect", str(path)])
    assert result.exit_code == 1
    assert "FAILED" in result.output and "truncated or padded" in result.output


def test_export_command_writes_the_files_and_reports(pipeline_shards, tmp_path):
    root = tmp_path / "run"
    shutil.copytree(pipeline_shards["bfloat16"].storage.url, root)
    out = tmp_path / "specforge"
    result = CliRunner().invoke(main, ["export", str(root), "--format", "specforge", str(out), "--finish-reason", "stop"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "export.json").read_text())
    assert f"exported:    {manifest['num_samples']} samples" in result.output and "as specforge (dflash)" in result.output
    assert "dflash_config.target_layer_ids = [1, 2, 3]" in result.output
    assert len(list(out.glob("data_*.ckpt"))) == manifest["num_samples"] > 0

    # These shards hold no last-layer entry: speculators' export is refused, with the setting that adds it.
    refused = CliRunner().invoke(main, ["export", str(root), "-f", "speculators", str(tmp_path / "sp")])
    assert refused.exit_code == 1 and "extract with extract.last_layer_state = true" in refused.output
    assert "dflash-queue reextract -c NEW_CONFIG --from CONFIG" in refused.output  # without generating again
    assert not (tmp_path / "sp").exists()

    (root / "shards" / "broken.safetensors").write_bytes(b"\x00" * 40)
    result = CliRunner().invoke(main, ["export", str(root), "-f", "specforge", str(tmp_path / "sf")])
    assert result.exit_code == 1
    assert "bad shard:   shards/broken.safetensors:" in result.output
    exported = json.loads((tmp_path / "sf" / "export.json").read_text())
    assert exported["num_samples"] + sum(exported["left_out"].values()) == 12  # the good shards are still exported
    assert len(list((tmp_path / "sf").glob("data_*.ckpt"))) == exported["num_samples"]

    result = CliRunner().invoke(main, ["export", str(tmp_path / "nothing"), "-f", "specforge", str(tmp_path / "x")])
    assert result.exit_code == 1 and "no such shard file or directory" in result.output


def test_export_refuses_suspect_shards_unless_told_to_skip_them_and_inspect_shows_the_mark(pipeline_shards, tmp_path):
    from dflash_queue.shards.suspects import SuspectMark, mark_suspect
    from dflash_queue.storage import LocalStorage

    root = tmp_path / "run"
    shutil.copytree(pipeline_shards["bfloat16"].storage.url, root)
    first, second = sorted((root / "shards").glob("*.safetensors"))
    suspect_id = first.name.removesuffix(".safetensors")
    mark_suspect(LocalStorage(root), SuspectMark(suspect_id, 0, "layer 3: worst token 2.0e+00", "", "extract@gpu-1"))

    out = tmp_path / "sf"
    refused = CliRunner().invoke(main, ["export", str(root), "-f", "specforge", str(out)])
    assert refused.exit_code == 1, refused.output
    assert "1 suspect shard(s)" in refused.output and f"shards/{first.name}: suspect: stored by extract@gpu-1" in \
        refused.output and "layer 3: worst token 2.0e+00" in refused.output and "--skip-suspect" in refused.output
    assert not out.exists()  # nothing written

    skipped = CliRunner().invoke(main, ["export", str(root), "-f", "specforge", str(out), "--skip-suspect"])
    assert skipped.exit_code == 0, skipped.output
    assert f"left out, suspect: shards/{first.name}: suspect: stored by extract@gpu-1" in skipped.output
    manifest = json.loads((out / "export.json").read_text())
    assert [entry["shard"] for entry in manifest["suspect_shards"]] == [f"shards/{first.name}"]
    assert "layer 3: worst token 2.0e+00" in manifest["suspect_shards"][0]["mark"]
    exported = {json.loads(line)["shard"] for line in (out / "index.jsonl").read_text().splitlines()}
    assert exported == {f"shards/{second.name}"}

    shown = CliRunner().invoke(main, ["inspect", str(first), "--json", "--no-checksum"])
    assert shown.exit_code == 0, shown.output  # whole, and suspect
    report = json.loads(shown.output)
    assert report["suspect"]["reason"] == "layer 3: worst token 2.0e+00" and report["suspect"]["node"] == "extract@gpu-1"
    assert {c["name"]: c["status"] for c in report["checks"]}["audit"] == "SUSPECT"


def test_export_gives_speculators_the_draft_vocabulary_asked_for(peer_shards, tmp_path):
    root = peer_shards["bfloat16"].storage.url
    out = tmp_path / "speculators"
    result = CliRunner().invoke(main, ["export", root, "-f", "speculators", str(out), "--draft-vocab-size", "7"])
    assert result.exit_code == 0, result.output
    trainer = json.loads((out / "export.json").read_text())["trainer"]
    assert trainer["draft_vocab_size"] == 7
    arguments = trainer["arguments"]
    assert arguments[arguments.index("--draft-vocab-size") + 1] == "7"
    refused = CliRunner().invoke(main, ["export", root, "-f", "speculators", str(tmp_path / "x"), "--draft-vocab-size",
                                        "0"])
    assert refused.exit_code == 2 and "--draft-vocab-size" in refused.output
