"""Where a training shard's suspect mark lies, whatever a reader was pointed at (shards/suspect_lookup.py)."""

from __future__ import annotations

from dflash_queue.shards.suspect_lookup import shard_place, suspect_marks
from dflash_queue.shards.suspects import SuspectMark, mark_suspect
from dflash_queue.storage import LocalStorage


def test_a_shards_run_root_epoch_and_id_come_from_its_whole_location(tmp_path):
    run = LocalStorage(tmp_path / "run")
    cases = {
        (run, "shards/a.safetensors"): (run.url, "", 0, "a"),
        (run, "epochs/3/shards/a.safetensors"): (run.url, "", 3, "a"),
        (LocalStorage(tmp_path), "run/shards/a.safetensors"): (str(tmp_path), "run/", 0, "a"),
        (LocalStorage(tmp_path / "run" / "shards"), "a.safetensors"): (run.url, "", 0, "a"),
        (LocalStorage(tmp_path / "run" / "epochs" / "2"), "shards/b.safetensors"): (run.url, "", 2, "b"),
    }
    for (storage, key), (root, prefix, epoch, shard_id) in cases.items():
        place = shard_place(storage, key)
        assert place is not None and (place.root.url, place.prefix, place.epoch, place.shard_id) == (
            root, prefix, epoch, shard_id), key
    assert shard_place(LocalStorage(tmp_path / "loose"), "a.safetensors") is None
    assert shard_place(run, "shards/a.json") is None


def test_marks_are_found_per_epoch_and_run_with_one_listing_per_root(tmp_path, monkeypatch):
    root = LocalStorage(tmp_path)
    run = LocalStorage(tmp_path / "run")
    mark_suspect(run, SuspectMark("a", 0, "bad", "a", "extract@x"))
    mark_suspect(run, SuspectMark("b", 1, "worse", "", "extract@y"))
    keys = ["run/shards/a.safetensors", "run/shards/b.safetensors", "run/epochs/1/shards/a.safetensors",
            "run/epochs/1/shards/b.safetensors"]
    listed = []
    original = LocalStorage.list

    def counting(self, prefix=""):
        listed.append(prefix)
        return original(self, prefix)

    monkeypatch.setattr(LocalStorage, "list", counting)
    found = suspect_marks(root, keys)
    assert {key: mark.reason for key, mark in found.items()} == {
        "run/shards/a.safetensors": "bad", "run/epochs/1/shards/b.safetensors": "worse",
    }
    assert listed == ["run/suspect/"]
