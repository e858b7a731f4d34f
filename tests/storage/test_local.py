from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_queue.errors import ConfigError, StorageError, StorageUnavailable
from dflash_queue.storage import LocalStorage, Storage, open_storage
from dflash_queue.storage.local import storage_error


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


@pytest.mark.parametrize(
    "code", [errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.ESTALE]
)
def test_errors_a_store_recovers_from_are_unavailable_and_name_path_and_errno(code):
    exc = OSError(code, os.strerror(code), "/data/run/shards/.tmp-abc")
    error = storage_error("/data/run", "write", "shards/s.safetensors", exc)
    assert isinstance(error, StorageUnavailable)
    assert errno.errorcode[code] in str(error) and "/data/run/shards/.tmp-abc" in str(error)
    assert "cannot write shards/s.safetensors" in str(error)


@pytest.mark.parametrize("code", [errno.ENOTDIR, errno.EEXIST, errno.EFBIG, errno.ENAMETOOLONG])
def test_errors_a_retry_cannot_fix_stay_plain_storage_errors(code):
    error = storage_error("/data/run", "write", "k", OSError(code, os.strerror(code)))
    assert type(error) is StorageError and errno.errorcode[code] in str(error)


# Runs in a child process: directory permissions must bind it even as root (see root_bypass_dropped), and a
# file-size limit must not touch the test runner.
WRITER = r"""
import json, os, resource, signal, sys
from dflash_queue.errors import StorageUnavailable
from dflash_queue.storage.local import LocalStorage
storage = LocalStorage(sys.argv[1])
out = {}
try:
    storage.write_bytes("shards/new.bin", b"x" * 100)
except StorageUnavailable as exc:
    out["read_only"] = str(exc)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
try:
    storage.write_bytes("old/v.bin", b"y" * 10_000)
except Exception as exc:
    out["too_big"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


def test_a_read_only_directory_is_unavailable_and_a_failed_write_leaves_nothing(tmp_path):
    from dfq_testing.jobs import read_only, root_bypass_dropped

    root = tmp_path / "root"
    storage = LocalStorage(root)
    storage.write_bytes("shards/done.bin", b"done")
    storage.write_bytes("old/v.bin", b"old")
    with read_only(root / "shards"):
        result = subprocess.run(
            [*root_bypass_dropped(), sys.executable, "-c", WRITER, str(root)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        out = json.loads(result.stdout)
        assert "EACCES" in out["read_only"] and str(root / "shards") in out["read_only"]
        assert sorted(p.name for p in (root / "shards").iterdir()) == ["done.bin"]
    # A write cut off half way (the file-size limit) keeps the old object whole and leaves no temp file.
    assert out["too_big"].startswith("StorageError: ") and "EFBIG" in out["too_big"]
    assert storage.read_bytes("old/v.bin") == b"old"
    assert [p.name for p in (root / "old").iterdir()] == ["v.bin"]
    # Writable again: the same write succeeds.
    storage.write_bytes("shards/new.bin", b"x" * 100)
    assert storage.read_bytes("shards/new.bin") == b"x" * 100


def test_delete_removes_the_folders_it_empties_and_no_others(tmp_path):
    storage = LocalStorage(tmp_path / "root")
    storage.write_bytes("a/b/one", b"1")
    storage.write_bytes("a/two", b"2")
    storage.delete("a/b/one")
    assert not (tmp_path / "root" / "a" / "b").exists()
    assert list(storage.list()) == ["a/two"]
    storage.delete("a/two")
    assert (tmp_path / "root").is_dir() and list((tmp_path / "root").iterdir()) == []
    storage.delete("a/never-written")  # deleting what is not there is no error
    storage.write_bytes("a/b/again", b"3")  # and the folders come back when written to
    assert storage.read_bytes("a/b/again") == b"3"


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_stored_files_honour_the_umask(tmp_path, umask):
    """A trainer running as another user reads the outputs when the umask allows (mkstemp alone gives 0600)."""
    import stat

    previous = os.umask(umask)
    try:
        storage = LocalStorage(tmp_path / "root")
        storage.write_bytes("shards/a.safetensors", b"x")
        source = tmp_path / "src"
        source.write_bytes(b"y")
        storage.write_file("shards/b.safetensors", source)
    finally:
        os.umask(previous)
    for key in ("shards/a.safetensors", "shards/b.safetensors"):
        assert stat.S_IMODE((tmp_path / "root" / key).stat().st_mode) == 0o666 & ~umask
