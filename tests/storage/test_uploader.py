"""The bounded background uploader, against local storage and the loopback S3 endpoint."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dflash_queue.errors import StorageAccessError
from dflash_queue.storage import LocalStorage
from dflash_queue.storage.config import S3Config
from dflash_queue.storage.process_dirs import host_tag
from dflash_queue.storage.s3 import S3Storage
from dflash_queue.storage.uploader import ShardUploader, UploaderFull


def test_back_pressure_when_max_pending_shards_wait(tmp_path):
    storage = LocalStorage(tmp_path / "store")
    uploader = ShardUploader(storage, tmp_path / "staging", max_pending=1, parallel_uploads=1)
    first = uploader.stage("a")
    first.path.write_bytes(b"shard a")
    assert uploader.pending == 1
    with pytest.raises(UploaderFull):
        uploader.stage("b", timeout=0)  # the staging area is full: the caller waits instead of writing more

    uploader.upload(first, "shards/a.safetensors").result()
    assert storage.read_bytes("shards/a.safetensors") == b"shard a"
    assert uploader.pending == 0 and not first.path.exists()
    second = uploader.stage("b", timeout=0)
    second.release()
    uploader.close()
    assert not uploader.directory.exists()


def test_staging_slot_returns_when_writing_the_shard_fails(tmp_path):
    uploader = ShardUploader(LocalStorage(tmp_path / "store"), tmp_path / "staging", max_pending=1, parallel_uploads=1)
    with pytest.raises(ValueError):
        with uploader.stage("a") as staged:
            staged.path.write_bytes(b"half")
            raise ValueError("non-finite hidden states")
    assert uploader.pending == 0 and list(uploader.directory.iterdir()) == []
    uploader.close()


def test_parallel_uploads_to_s3_are_all_stored(s3_server, s3_bucket, tmp_path):
    storage = S3Storage(f"s3://{s3_bucket}/run", S3Config(endpoint_url=s3_server.endpoint_url))
    uploader = ShardUploader(storage, tmp_path / "staging", max_pending=4, parallel_uploads=3)
    payloads = {f"shards/{i}.safetensors": os.urandom(256 * 1024) for i in range(6)}
    futures = []
    for key, data in payloads.items():
        staged = uploader.stage(key.split("/")[1])
        staged.path.write_bytes(data)
        futures.append(uploader.upload(staged, key))
    for future in futures:
        future.result()
    for key, data in payloads.items():
        assert storage.read_bytes(key) == data
    uploader.close()
    assert uploader.pending == 0


def test_failed_upload_raises_from_the_future_and_frees_its_slot(s3_server, s3_env, tmp_path):
    storage = S3Storage("s3://no-such-bucket-x/run", S3Config(endpoint_url=s3_server.endpoint_url, max_attempts=1))
    uploader = ShardUploader(storage, tmp_path / "staging", max_pending=1, parallel_uploads=1)
    staged = uploader.stage("a")
    staged.path.write_bytes(b"x")
    with pytest.raises(StorageAccessError, match="NoSuchBucket"):
        uploader.upload(staged, "shards/a.safetensors").result()
    assert uploader.pending == 0 and list(uploader.directory.iterdir()) == []
    uploader.close()


def test_close_finishes_uploads_already_handed_over(tmp_path):
    storage = LocalStorage(tmp_path / "store")
    uploader = ShardUploader(storage, tmp_path / "staging", max_pending=3, parallel_uploads=1)
    for name in "abc":
        staged = uploader.stage(name)
        staged.path.write_bytes(name.encode() * 1000)
        uploader.upload(staged, f"shards/{name}.safetensors")
    uploader.close()
    assert sorted(storage.list("shards/")) == [f"shards/{n}.safetensors" for n in "abc"]


def test_staging_left_by_dead_processes_is_removed(tmp_path):
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(finished.stdout)
    root = tmp_path / "staging"
    abandoned = root / f"{host_tag()}-{dead_pid}"
    abandoned.mkdir(parents=True)
    (abandoned / "x.part").write_bytes(b"left over")
    alive = root / f"{host_tag()}-{os.getppid()}"  # a running process: kept
    alive.mkdir()
    other_host = root / f"another-host-{dead_pid}"  # another machine's: kept
    other_host.mkdir()
    uploader = ShardUploader(LocalStorage(tmp_path / "store"), root)
    assert not abandoned.exists() and alive.exists() and other_host.exists()
    uploader.close()
