from __future__ import annotations

import os
from pathlib import Path

import pytest

from dflash_queue.errors import ConfigError, StorageError
from dflash_queue.storage import LocalStorage, Storage, open_storage


def test_local_storage_round_trip_and_listing(tmp_path):
    storage = open_storage(str(tmp_path / "root"))
    assert isinstance(storage, Storage)
    storage.write_bytes("prompts/a.jsonl", b"one")
    storage.write_bytes("shards/b.safetensors", b"two")
    assert storage.exists("prompts/a.jsonl") and not storage.exists("prompts/zz.jsonl")
    assert storage.read_bytes("prompts/a.jsonl") == b"one"
    assert sorted(storage.list("shards/")) == ["shards/b.safetensors"]
    assert sorted(storage.list()) == ["prompts/a.jsonl", "shards/b.safetensors"]
    assert storage.size("shards/b.safetensors") == 3
    storage.delete("prompts/a.jsonl")
    assert not storage.exists("prompts/a.jsonl")


def test_write_file_is_atomic_and_leaves_no_temp_files(tmp_path):
    storage = LocalStorage(tmp_path / "root")
    source = tmp_path / "big.bin"
    source.write_bytes(os.urandom(3 << 20))
    storage.write_file("shards/x.safetensors", source)
    assert storage.read_bytes("shards/x.safetensors") == source.read_bytes()
    assert [p.name for p in (tmp_path / "root" / "shards").iterdir()] == ["x.safetensors"]
    with storage.local_copy("shards/x.safetensors") as path:
        assert path.read_bytes()[:10] == source.read_bytes()[:10]


def test_failed_write_keeps_the_old_object_and_cleans_up(tmp_path):
    storage = LocalStorage(tmp_path / "root")
    storage.write_bytes("k/v.bin", b"old")

    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        with storage._atomic_target("k/v.bin") as handle:
            handle.write(b"partial")
            raise Boom
    assert storage.read_bytes("k/v.bin") == b"old"
    assert [p.name for p in (tmp_path / "root" / "k").iterdir()] == ["v.bin"]


def test_unwritable_location_raises_storage_error(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    (root / "k").write_text("a file where a directory should be")
    with pytest.raises(StorageError, match="cannot write k/v.bin"):
        LocalStorage(root).write_bytes("k/v.bin", b"x")


@pytest.mark.parametrize("key", ["", "/abs", "../escape", "a/../../b"])
def test_keys_cannot_escape_the_root(tmp_path, key):
    with pytest.raises(StorageError):
        LocalStorage(tmp_path).write_bytes(key, b"x")


def test_unknown_scheme_is_a_config_error():
    with pytest.raises(ConfigError, match="unsupported scheme 'gs'"):
        open_storage("gs://bucket/prefix")


def test_file_url_is_local(tmp_path: Path):
    assert isinstance(open_storage(f"file://{tmp_path}"), LocalStorage)


def test_read_range_reads_exactly_the_bytes_asked(tmp_path):
    from dflash_queue.storage import RangeReadable

    storage = LocalStorage(tmp_path / "root")
    payload = os.urandom(10_000)
    storage.write_bytes("shards/r.safetensors", payload)
    assert isinstance(storage, RangeReadable)
    assert storage.read_range("shards/r.safetensors", 0, 8) == payload[:8]
    assert storage.read_range("shards/r.safetensors", 4321, 1000) == payload[4321:5321]
    assert storage.read_range("shards/r.safetensors", 10_000, 0) == b""
    with pytest.raises(StorageError, match="fewer than the range \\[9990, 10010\\)"):
        storage.read_range("shards/r.safetensors", 9990, 20)
    with pytest.raises(StorageError, match="invalid byte range"):
        storage.read_range("shards/r.safetensors", -1, 5)
    with pytest.raises(FileNotFoundError):
        storage.read_range("shards/missing.safetensors", 0, 1)
