"""ShardDataset over shards made by the real generate and extract lanes."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader

from dflash_queue.errors import ShardFormatError
from dflash_queue.shards.completions import decode_completions
from dflash_queue.shards.keys import completions_key, shard_id_of
from dflash_queue.shards.training import TrainingShard
from dflash_queue.storage import LocalStorage
from dflash_queue.training import ShardDataset, collate_padded


def shard_paths(root: str | Path) -> list[Path]:
    return sorted(Path(root, "shards").glob("*.safetensors"))


def copy_run(config, tmp_path: Path) -> Path:
    target = tmp_path / "run"
    shutil.copytree(config.storage.url, target)
    return target


def rewrite_metadata(path: Path, **changes: str) -> None:
    tensors = load_file(str(path))
    with safe_open(str(path), "pt") as handle:
        metadata = {**handle.metadata(), **changes}
    save_file(tensors, str(path), metadata=metadata)


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8_e4m3", "float32"])
def test_items_equal_the_shards_and_the_generated_ids(pipeline_shards, dtype):
    config = pipeline_shards[dtype]
    storage = LocalStorage(config.storage.url)
    dataset = ShardDataset(config.storage.url)
    paths = shard_paths(config.storage.url)
    assert len(dataset) == 12 == sum(len(TrainingShard(p)) for p in paths)
    assert dataset.layer_ids == (1, 2, 3) and dataset.hidden_size == 128
    assert dataset.target_model == "tiny-qwen3" and dataset.layer_convention == "decoder_layer_output"
    assert dataset.keys == [f"shards/{p.name}" for p in paths]

    i = 0
    for path in paths:
        shard = TrainingShard(path)
        completions = {c.id: c for c in decode_completions(storage.read_bytes(completions_key(shard_id_of(path.name))), what=path.name)}
        for row in range(len(shard)):
            item, want = dataset[i], shard[row]
            record = completions[item["sample_id"]]
            assert item["sample_id"] == want.id and item["shard"] == f"shards/{path.name}"
            assert item["input_ids"].dtype == torch.int64 and item["loss_mask"].dtype == torch.int64
            assert item["input_ids"].tolist() == record.prompt_ids + record.completion_ids
            assert item["loss_mask"].tolist() == [0] * len(record.prompt_ids) + [1] * len(record.completion_ids)
            assert item["hidden_states"].dtype == torch.bfloat16
            assert item["hidden_states"].shape == (len(item["input_ids"]), 3, 128)
            assert torch.equal(item["hidden_states"], want.hidden_states.to(torch.bfloat16))
            assert item["finish_reason"] == record.finish_reason and item["thinking"] == record.thinking
            assert item["quality_flags"] == list(record.quality.flags)
            assert dataset.lengths[i] == len(item["input_ids"])
            i += 1
    assert dataset.num_tokens == sum(TrainingShard(p).num_tokens for p in paths)
    if dtype == "float32":
        exact = ShardDataset(config.storage.url, hidden_dtype=torch.float32)
        for j in (0, 5, 11):
            row_shard = TrainingShard(Path(config.storage.url) / exact.keys[exact._locate(j)[0]])
            assert torch.equal(exact[j]["hidden_states"], row_shard[exact._locate(j)[1]].hidden_states)


def ids_and_states(dataset: ShardDataset) -> dict[str, torch.Tensor]:
    items = [dataset[i] for i in range(len(dataset))]
    return {item["sample_id"]: item["hidden_states"] for item in items}


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_a_dataloader_with_two_workers_yields_every_sample_once(pipeline_shards, context):
    dataset = ShardDataset(pipeline_shards["fp8_e4m3"].storage.url)
    expected = ids_and_states(dataset)  # the parent opened files first: forked workers must open their own
    loader = DataLoader(
        dataset,
        batch_size=5,
        shuffle=True,
        generator=torch.Generator().manual_seed(0),
        num_workers=2,
        multiprocessing_context=context,
        collate_fn=collate_padded,
    )
    seen: dict[str, torch.Tensor] = {}
    for batch in loader:
        assert batch["hidden_states"].shape[0] == len(batch["sample_id"]) <= 5
        for row, sample_id in enumerate(batch["sample_id"]):
            length = int(batch["lengths"][row])
            assert batch["attention_mask"][row].sum() == length
            assert not batch["hidden_states"][row, length:].any()
            assert sample_id not in seen
            seen[sample_id] = batch["hidden_states"][row, :length]
    assert seen.keys() == expected.keys()
    for sample_id, states in expected.items():
        assert torch.equal(seen[sample_id], states)


def test_filters_by_finish_reason_and_quality_flags(pipeline_shards, tmp_path):
    root = copy_run(pipeline_shards["bfloat16"], tmp_path)
    everything = ShardDataset(root)
    reasons = [everything[i]["finish_reason"] for i in range(len(everything))]
    assert {"stop", "length"} <= set(reasons)
    stopped = ShardDataset(root, finish_reasons={"stop"})
    assert len(stopped) == reasons.count("stop") and stopped.dropped == {"finish_reason=length": reasons.count("length")}
    assert all(stopped[i]["finish_reason"] == "stop" for i in range(len(stopped)))

    first, second = shard_paths(root)
    first_flags = [["empty_answer"], [], ["repetition", "truncated"], [], [], []]
    rewrite_metadata(first, quality=json.dumps([{"flags": flags} for flags in first_flags]))
    verdicts = [{"flags": ["repetition"] if i == 4 else [], "answer_tokens": 1, "thinking": "closed"} for i in range(6)]
    rewrite_metadata(second, quality=json.dumps(verdicts))
    flagged_ids = {everything[i]["sample_id"] for i in (0, 2, 10)}

    flagged = ShardDataset(root)
    assert {flagged[i]["sample_id"] for i in range(12) if flagged[i]["quality_flags"]} == flagged_ids
    assert flagged[2]["quality_flags"] == ["repetition", "truncated"]
    clean = ShardDataset(root, drop_flagged=True)
    assert len(clean) == 9 and clean.dropped == {"flagged": 3}
    assert flagged_ids.isdisjoint(clean[i]["sample_id"] for i in range(len(clean)))
    no_repeats = ShardDataset(root, exclude_flags={"repetition"})
    assert len(no_repeats) == 10
    assert {m for i in range(10) for m in no_repeats[i]["quality_flags"]} == {"empty_answer"}
    short = ShardDataset(root, where=lambda meta: meta.num_tokens < 60)
    assert all(short.meta(i).num_tokens < 60 for i in range(len(short))) and short.dropped["where"] > 0


def test_bad_shards_are_skipped_and_reported_or_refused(pipeline_shards, tmp_path):
    root = copy_run(pipeline_shards["bfloat16"], tmp_path)
    first = shard_paths(root)[0]
    truncated = root / "shards" / "truncated.safetensors"
    truncated.write_bytes(first.read_bytes()[:-100])
    (root / "shards" / "junk.safetensors").write_bytes(b"not a shard at all")
    with pytest.warns(UserWarning, match="skipping shard") as warned:
        dataset = ShardDataset(root)
    assert len(warned) == 2 and len(dataset) == 12
    problems = dict(dataset.bad_shards)
    assert set(problems) == {"shards/junk.safetensors", "shards/truncated.safetensors"}
    assert "truncated or padded" in problems["shards/truncated.safetensors"]
    assert str(truncated) in problems["shards/truncated.safetensors"]
    assert "not plausible" in problems["shards/junk.safetensors"]
    with pytest.raises(ShardFormatError, match="junk.safetensors"):
        ShardDataset(root, on_bad_shard="raise")


def test_shards_of_other_layers_are_not_mixed_in(pipeline_shards, tmp_path):
    root = copy_run(pipeline_shards["bfloat16"], tmp_path)
    first, second = shard_paths(root)
    rewrite_metadata(second, layer_ids="[0, 2, 4]")
    with pytest.warns(UserWarning, match=r"layer_ids \(0, 2, 4\) differs from \(1, 2, 3\)"):
        dataset = ShardDataset(root)
    assert dataset.keys == [f"shards/{first.name}"] and len(dataset.bad_shards) == 1


class WholeOnly:
    """A storage that is not LocalStorage and has no ranged reads: objects come whole."""

    def __init__(self, root: Path) -> None:
        self.inner = LocalStorage(root)
        self.url = f"other+{self.inner.url}"
        self.ranged_reads = 0

    def list(self, prefix: str = ""):
        return self.inner.list(prefix)

    def size(self, key: str) -> int:
        return self.inner.size(key)

    def read_bytes(self, key: str) -> bytes:
        return self.inner.read_bytes(key)


class RangedOnly(WholeOnly):
    """... and one that offers read_range: the path object stores take."""

    def read_range(self, key: str, start: int, length: int) -> bytes:
        self.ranged_reads += 1
        return self.inner.read_range(key, start, length)


def test_storages_without_local_files_read_by_ranges_or_whole(pipeline_shards):
    root = Path(pipeline_shards["fp8_e4m3"].storage.url)
    expected = ids_and_states(ShardDataset(root))
    ranged = RangedOnly(root)
    dataset = ShardDataset(ranged)
    reads_for_index = ranged.ranged_reads
    assert reads_for_index == 2 * 2  # per shard: the header probe and the offsets
    got = ids_and_states(dataset)  # reads every item once
    # input_ids, loss_mask, hidden_states, hidden_scales: four ranged reads per item, never the whole shard.
    assert ranged.ranged_reads - reads_for_index == 4 * len(dataset)
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)
    with pytest.warns(UserWarning, match="no read_range"):
        whole = ShardDataset(WholeOnly(root))
    assert len(whole) == len(dataset)
    assert all(torch.equal(whole[i]["hidden_states"], expected[whole[i]["sample_id"]]) for i in range(len(whole)))


def test_pickled_copies_and_single_shard_targets(pipeline_shards, monkeypatch):
    from dflash_queue.training import dataset as dataset_module

    root = Path(pipeline_shards["bfloat16"].storage.url)
    dataset = ShardDataset(root)
    monkeypatch.setattr(dataset_module, "MAX_OPEN_SHARDS", 1)
    first = [dataset[i]["hidden_states"] for i in (0, 6, 1, 7)]  # alternating shards: each read reopens
    assert len(dataset._sources) == 1
    monkeypatch.undo()
    assert all(torch.equal(a, dataset[i]["hidden_states"]) for a, i in zip(first, (0, 6, 1, 7)))
    assert len(dataset._sources) == 2
    copy = pickle.loads(pickle.dumps(ShardDataset(root, where=lambda meta: meta.num_tokens > 0)))
    assert copy._sources == {} and len(copy) == len(dataset)
    assert torch.equal(copy[7]["hidden_states"], dataset[7]["hidden_states"])
    path = shard_paths(root)[1]
    one = ShardDataset(path)
    assert len(one) == 6 and one.keys == [path.name]
    assert torch.equal(one[0]["hidden_states"], dataset[6]["hidden_states"])
    assert len(ShardDataset(f"file://{root}")) == 12
    assert len(ShardDataset(root, keys=[f"shards/{path.name}"])) == 6
    with pytest.raises(ShardFormatError, match="no such shard file or directory"):
        ShardDataset(root / "missing")
    with pytest.raises(IndexError):
        dataset[12]


def test_fp8_states_can_come_as_stored_for_dequantising_on_the_gpu(pipeline_shards):
    from dflash_queue.shards.fp8 import dequantize_fp8

    root = pipeline_shards["fp8_e4m3"].storage.url
    dequantized = ShardDataset(root)
    raw = ShardDataset(root, dequantize=False)
    loader = DataLoader(raw, batch_size=4, num_workers=2, collate_fn=collate_padded)
    i = 0
    for batch in loader:
        assert batch["hidden_states"].dtype == torch.float8_e4m3fn and batch["hidden_scales"].dtype == torch.float32
        for row in range(len(batch["sample_id"])):
            length = int(batch["lengths"][row])
            states = dequantize_fp8(batch["hidden_states"][row, :length], batch["hidden_scales"][row, :length])
            assert torch.equal(states, dequantized[i]["hidden_states"])
            i += 1
    assert i == len(dequantized) == 12
    assert "hidden_scales" not in ShardDataset(pipeline_shards["bfloat16"].storage.url, dequantize=False)[0]


def test_suspect_shards_are_left_out_when_listed_and_refused_when_named(pipeline_shards, tmp_path):
    from dflash_queue.shards.suspects import SuspectMark, clear_mark, mark_suspect
    from dflash_queue.training import SuspectShardError

    root = copy_run(pipeline_shards["bfloat16"], tmp_path)
    storage = LocalStorage(root)
    first, second = shard_paths(root)
    suspect_id = first.name.removesuffix(".safetensors")
    mark_suspect(storage, SuspectMark(suspect_id, 0, "layer 2: worst token 1.3e+00", suspect_id, "extract@node-a"))

    # Found by listing (the run's root or its shards/ folder): left out, with one warning naming it and why.
    for target in (root, root / "shards"):
        with pytest.warns(UserWarning, match=rf"leaving out 1 suspect shard.*{suspect_id}\.safetensors \(layer 2: worst token"):
            dataset = ShardDataset(target)
        assert len(dataset) == 6 and dataset.keys[0].endswith(second.name)
        assert [key for key, _ in dataset.suspect_shards] == [dataset.keys[0].replace(second.name, first.name)]
        assert "stored by extract@node-a" in dataset.suspect_shards[0][1]
        assert {dataset[i]["sample_id"] for i in range(6)}.isdisjoint(TrainingShard(first).sample_ids)
    # Named (a file, keys=): refused, naming the shard and the reason; or left out on request.
    for named in ({"shards": first}, {"shards": root, "keys": [f"shards/{first.name}"]}):
        with pytest.raises(SuspectShardError, match=rf"{first.name}: suspect: stored by extract@node-a.*layer 2"):
            ShardDataset(**named)
    assert ShardDataset(first, on_suspect_shard="skip").shards == []
    with pytest.raises(SuspectShardError):
        ShardDataset(root, on_suspect_shard="raise")
    assert len(ShardDataset(second)) == 6

    # A later epoch's mark is that epoch's copy only.
    (root / "epochs" / "1" / "shards").mkdir(parents=True)
    shutil.copy(first, root / "epochs" / "1" / "shards" / first.name)
    clear_mark(storage, suspect_id, 0)
    mark_suspect(storage, SuspectMark(suspect_id, 1, "epoch 1 fault", "", "extract@node-b"))
    assert len(ShardDataset(root)) == 12
    with pytest.warns(UserWarning, match="epoch 1 fault"):
        assert len(ShardDataset(root, prefix="epochs/1/")) == 0


def test_suspect_shards_in_s3_are_found_above_the_storage_read(pipeline_shards, s3_server, s3_bucket):
    from dflash_queue.shards.suspects import SuspectMark, mark_suspect
    from dflash_queue.storage.config import S3Config
    from dflash_queue.storage.s3 import S3Storage
    from dflash_queue.training import SuspectShardError

    settings = S3Config(endpoint_url=s3_server.endpoint_url)
    run = S3Storage(f"s3://{s3_bucket}/run", settings)
    first, second = shard_paths(pipeline_shards["fp8_e4m3"].storage.url)
    for path in (first, second):
        run.write_file(f"shards/{path.name}", path)
    suspect_id = first.name.removesuffix(".safetensors")
    mark_suspect(run, SuspectMark(suspect_id, 0, "last layer off by one token", suspect_id, "extract@gpu-3"))
    with pytest.warns(UserWarning, match=f"leaving out 1 suspect shard.*{suspect_id}"):
        dataset = ShardDataset(run)
    assert len(dataset) == 6 and dataset.keys == [f"shards/{second.name}"]
    # The shards/ folder opened as a storage of its own: the mark is looked for at the run's root, same settings.
    folder = S3Storage(f"s3://{s3_bucket}/run/shards", settings)
    with pytest.raises(SuspectShardError, match="last layer off by one token"):
        ShardDataset(folder, keys=[first.name])
    assert len(ShardDataset(folder, keys=[second.name])) == 6
