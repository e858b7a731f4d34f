from __future__ import annotations

import hashlib
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch

from dflash_queue.shards.inspection import FAILED, OK, SKIPPED, UNRECORDED, inspect_shard, sample_preview
from dflash_queue.shards.ranges import LocalFileSource
from dflash_queue.shards.reader import ShardIndex
from dflash_queue.shards.training import TrainingShard
from dflash_queue.storage import LocalStorage


@pytest.fixture
def run_copy(pipeline_shards, tmp_path):
    def copy(dtype: str) -> tuple[LocalStorage, str, Path]:
        root = tmp_path / dtype
        shutil.copytree(pipeline_shards[dtype].storage.url, root)
        path = sorted((root / "shards").glob("*.safetensors"))[0]
        return LocalStorage(root), f"shards/{path.name}", path

    return copy


def statuses(report) -> dict[str, str]:
    return {check.name: check.status for check in report.checks}


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8_e4m3"])
def test_report_of_a_whole_shard(run_copy, dtype):
    storage, key, path = run_copy(dtype)
    shard = TrainingShard(path)
    report = inspect_shard(storage, key, deep=True)
    assert report.ok and statuses(report) == {
        "structure": OK, "layers": OK, "loss_mask": OK, "values": OK, "audit": OK, "checksum": UNRECORDED,
    }
    assert report.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    # Local storage keeps no checksum: said so, not as if one were missing.
    checksum = next(check.detail for check in report.checks if check.name == "checksum")
    assert f"local storage keeps no checksum; a {key}.sha256 file beside it would be compared" in checksum
    summary = report.summary()
    lengths = [len(shard[i].input_ids) for i in range(len(shard))]
    assert summary["samples"] == 6 and summary["tokens"] == shard.num_tokens == sum(lengths)
    assert summary["completion_tokens"] == sum(int(shard[i].loss_mask.sum()) for i in range(len(shard)))
    assert summary["tokens_per_sample"] == (min(lengths), round(sum(lengths) / 6, 1), max(lengths))
    assert summary["layer_ids"] == [1, 2, 3] and summary["dtype"] == dtype and summary["hidden_size"] == 128
    assert summary["size_bytes"] == path.stat().st_size
    assert summary["bytes_per_token"] == round(path.stat().st_size / shard.num_tokens, 1)
    assert sum(report.finish_reasons.values()) == 6
    assert report.quality_flags == Counter(flag for i in range(len(shard)) for flag in shard[i].flags)
    preview = sample_preview(storage, key, report.index, 2)
    assert preview["id"] == shard[2].id and preview["input_ids"] == shard[2].input_ids.tolist()
    assert preview["completion_start"] == int(torch.nonzero(shard[2].loss_mask)[0])


def test_checksum_recorded_next_to_the_shard_is_compared(run_copy):
    storage, key, path = run_copy("bfloat16")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    storage.write_bytes(key + ".sha256", f"{digest}  {path.name}\n".encode())
    report = inspect_shard(storage, key)
    assert report.ok and statuses(report)["checksum"] == OK and "matches" in report.checks[-1].detail
    assert statuses(report)["values"] == SKIPPED
    storage.write_bytes(key + ".sha256", ("0" * 64).encode())
    report = inspect_shard(storage, key)
    assert not report.ok and statuses(report)["checksum"] == FAILED
    assert f"recorded {'0' * 64}" in report.checks[-1].detail
    assert statuses(inspect_shard(storage, key, checksum=False))["checksum"] == SKIPPED


def test_damage_is_found_and_located(run_copy):
    storage, key, path = run_copy("bfloat16")
    index = ShardIndex.load(LocalFileSource(path))
    start, _ = index.rows(3)
    data = bytearray(path.read_bytes())
    spec = index.layout["hidden_states"]
    at = spec.begin + (start + 1) * spec.row_bytes + 10
    data[at : at + 2] = b"\xc0\x7f"  # a bf16 NaN inside sample 3
    mask = index.layout["loss_mask"]
    data[mask.begin] = 2
    path.write_bytes(bytes(data))
    report = inspect_shard(storage, key, deep=True)
    assert statuses(report) == {
        "structure": OK, "layers": OK, "loss_mask": FAILED, "values": FAILED, "audit": OK, "checksum": UNRECORDED,
    }
    details = {check.name: check.detail for check in report.checks}
    assert f"sample 3 ({index.sample_ids[3]}) has NaN or Inf" in details["values"]
    assert "1 loss_mask values other than 0 and 1" in details["loss_mask"]

    path.write_bytes(bytes(data[:-50]))
    report = inspect_shard(storage, key)
    assert statuses(report) == {"structure": FAILED, "audit": OK, "checksum": UNRECORDED} and report.index is None
    assert "truncated or padded" in report.checks[0].detail and report.summary()["size_bytes"] == len(data) - 50


def test_a_suspect_shard_shows_its_mark_without_failing_the_report(run_copy, tmp_path):
    from dflash_queue.shards.inspection import SUSPECT
    from dflash_queue.shards.suspects import SuspectMark, clear_mark, mark_suspect

    storage, key, path = run_copy("bfloat16")
    shard_id = path.name.removesuffix(".safetensors")
    mark_suspect(storage, SuspectMark(shard_id, 0, "layer 2: worst token 1.3e+00", "s-first", "extract@node-a"))
    report = inspect_shard(storage, key, checksum=False)
    assert report.ok and statuses(report)["audit"] == SUSPECT  # whole, and suspect
    assert report.suspect is not None and report.suspect.reason == "layer 2: worst token 1.3e+00"
    detail = {check.name: check.detail for check in report.checks}["audit"]
    assert "stored by extract@node-a; the audit of shard s-first: layer 2: worst token 1.3e+00" in detail
    # The file itself, inspected from its shards/ folder, finds the mark at the run's root.
    assert statuses(inspect_shard(LocalStorage(path.parent), path.name, checksum=False))["audit"] == SUSPECT
    clear_mark(storage, shard_id, 0)
    assert statuses(inspect_shard(storage, key, checksum=False))["audit"] == OK
    loose = tmp_path / "loose"
    loose.mkdir()
    shutil.copy(path, loose / "a.safetensors")  # outside a run's layout: no mark to look for
    assert statuses(inspect_shard(LocalStorage(loose), "a.safetensors", checksum=False))["audit"] == SKIPPED
