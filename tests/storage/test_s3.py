"""S3Storage against a real S3-compatible HTTP endpoint on loopback (moto's threaded server)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from dflash_queue.errors import ChecksumMismatch, ConfigError, StorageAccessError, StorageUnavailable
from dflash_queue.storage import Storage, open_storage
from dflash_queue.storage.config import S3Config, StorageConfig
from dflash_queue.storage.s3 import SHA256_METADATA, S3Storage
from dfq_testing.s3 import LoopbackS3

MiB = 1024 * 1024


def make_storage(server: LoopbackS3, bucket: str, prefix: str = "run", **settings) -> S3Storage:
    settings = {"endpoint_url": server.endpoint_url, "max_attempts": 2, "connect_timeout_s": 1.0, **settings}
    return S3Storage(f"s3://{bucket}/{prefix}", S3Config(**settings))


def test_round_trip_under_the_prefix_with_checksums(s3_server, s3_bucket):
    storage = make_storage(s3_server, s3_bucket)
    assert isinstance(storage, Storage)
    storage.write_bytes("prompts/a.jsonl", b"one\n")
    storage.write_bytes("shards/b.safetensors", b"two")
    assert storage.read_bytes("prompts/a.jsonl") == b"one\n"
    assert storage.exists("shards/b.safetensors") and not storage.exists("shards/zz.safetensors")
    assert storage.size("shards/b.safetensors") == 3
    assert sorted(storage.list("shards/")) == ["shards/b.safetensors"]
    assert sorted(storage.list()) == ["prompts/a.jsonl", "shards/b.safetensors"]

    raw = s3_server.client()
    head = raw.head_object(Bucket=s3_bucket, Key="run/prompts/a.jsonl", ChecksumMode="ENABLED")
    assert head["Metadata"][SHA256_METADATA] == hashlib.sha256(b"one\n").hexdigest()
    assert "ChecksumCRC32" in head  # the store received and kept the S3 checksum too
    storage.delete("prompts/a.jsonl")
    assert not storage.exists("prompts/a.jsonl")
    with pytest.raises(FileNotFoundError, match=rf"s3://{s3_bucket}/run/prompts/a.jsonl"):
        storage.read_bytes("prompts/a.jsonl")


def test_open_storage_picks_s3_with_the_configured_settings(s3_server, s3_bucket):
    config = StorageConfig(url=f"s3://{s3_bucket}/deep/prefix/", s3=S3Config(endpoint_url=s3_server.endpoint_url))
    storage = open_storage(config)
    assert isinstance(storage, S3Storage)
    assert (storage.bucket, storage.prefix) == (s3_bucket, "deep/prefix/")
    assert storage.url == f"s3://{s3_bucket}/deep/prefix/"
    storage.write_bytes("k.txt", b"x")
    assert [o["Key"] for o in s3_server.client().list_objects_v2(Bucket=s3_bucket)["Contents"]] == ["deep/prefix/k.txt"]


def test_endpoint_and_region_can_come_from_the_aws_environment(s3_server, s3_bucket, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_server.endpoint_url)
    storage = open_storage(f"s3://{s3_bucket}/env")
    storage.write_bytes("k", b"from env")
    assert storage.client.meta.endpoint_url == s3_server.endpoint_url
    assert storage.read_bytes("k") == b"from env"


@pytest.mark.parametrize("key", ["", "/abs", "../escape", "a/../../b"])
def test_keys_cannot_escape_the_prefix(s3_server, s3_bucket, key):
    with pytest.raises(Exception, match="invalid storage key"):
        make_storage(s3_server, s3_bucket).write_bytes(key, b"x")


def test_multipart_upload_above_the_part_size(s3_server, s3_bucket, tmp_path):
    storage = make_storage(s3_server, s3_bucket, multipart_threshold_mb=5, part_size_mb=5, max_concurrency=4)
    source = tmp_path / "shard.bin"
    source.write_bytes(os.urandom(12 * MiB + 123))
    storage.write_file("shards/big.safetensors", source)

    raw = s3_server.client()
    head = raw.head_object(Bucket=s3_bucket, Key="run/shards/big.safetensors", ChecksumMode="ENABLED")
    assert head["ETag"].strip('"').endswith("-3")  # three parts: 5 + 5 + 2 MiB
    assert head["Metadata"][SHA256_METADATA] == hashlib.sha256(source.read_bytes()).hexdigest()
    assert "ChecksumCRC32" in head  # per-part checksums, combined by the store
    assert raw.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []
    with storage.local_copy("shards/big.safetensors") as path:
        assert path.read_bytes() == source.read_bytes()
    assert storage.read_bytes("shards/big.safetensors") == source.read_bytes()
    # Large in-memory writes take the same path.
    storage.write_bytes("completions/big.jsonl", source.read_bytes())
    assert raw.head_object(Bucket=s3_bucket, Key="run/completions/big.jsonl")["ETag"].strip('"').endswith("-3")


def test_corrupted_object_is_detected_on_read(s3_server, s3_bucket, tmp_path):
    storage = make_storage(s3_server, s3_bucket)
    storage.write_bytes("completions/c.jsonl", b'{"id": "a"}\n')
    source = tmp_path / "s.bin"
    source.write_bytes(b"hidden states")
    storage.write_file("shards/c.safetensors", source)

    raw = s3_server.client()
    for key in ("run/completions/c.jsonl", "run/shards/c.safetensors"):
        # Rewrite the bytes behind the storage layer's back, keeping the old sha256 metadata.
        metadata = raw.head_object(Bucket=s3_bucket, Key=key)["Metadata"]
        raw.put_object(Bucket=s3_bucket, Key=key, Body=b"bit rot", Metadata=metadata)
    with pytest.raises(ChecksumMismatch, match=rf"s3://{s3_bucket}/run/completions/c.jsonl: checksum mismatch"):
        storage.read_bytes("completions/c.jsonl")
    with pytest.raises(ChecksumMismatch, match=rf"s3://{s3_bucket}/run/shards/c.safetensors: checksum mismatch"):
        with storage.local_copy("shards/c.safetensors"):
            pass


def test_object_without_checksum_metadata_is_refused(s3_server, s3_bucket):
    s3_server.client().put_object(Bucket=s3_bucket, Key="run/prompts/x.jsonl", Body=b"{}\n")
    with pytest.raises(ChecksumMismatch, match="no dfq-sha256 metadata"):
        make_storage(s3_server, s3_bucket).read_bytes("prompts/x.jsonl")


@pytest.mark.parametrize("algorithm, header", [("SHA256", "ChecksumSHA256"), ("SHA1", "ChecksumSHA1"), ("none", None)])
def test_checksum_algorithm_setting(s3_server, s3_bucket, algorithm, header):
    storage = make_storage(s3_server, s3_bucket, checksum_algorithm=algorithm)
    storage.write_bytes("k", b"payload")
    head = s3_server.client().head_object(Bucket=s3_bucket, Key="run/k", ChecksumMode="ENABLED")
    if header:
        assert header in head
    else:
        assert not [name for name in head if name.startswith("Checksum") and name != "ChecksumType"]
    assert storage.read_bytes("k") == b"payload"  # the sha256 metadata is checked either way


def test_crashed_multipart_upload_is_invisible_and_cleaned_up(s3_server, s3_bucket):
    raw = s3_server.client()
    # What a worker killed mid-upload leaves behind: an upload with one part and no completion.
    started = raw.create_multipart_upload(Bucket=s3_bucket, Key="run/shards/dead.safetensors")
    raw.upload_part(
        Bucket=s3_bucket, Key="run/shards/dead.safetensors", UploadId=started["UploadId"], PartNumber=1, Body=b"x" * MiB
    )
    storage = make_storage(s3_server, s3_bucket)
    assert not storage.exists("shards/dead.safetensors")
    assert list(storage.list("shards/")) == []
    assert [key for key, _ in storage.incomplete_uploads()] == ["shards/dead.safetensors"]
    assert storage.abort_stale_uploads(older_than_s=0) == 1
    assert raw.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []


def test_failed_multipart_upload_is_aborted_once_the_endpoint_is_back(s3_env, tmp_path):
    """The endpoint goes away after the first part: the upload fails as unavailable, nothing appears under
    the key, and the half-done upload is aborted when the store answers again."""
    with LoopbackS3() as server:
        server.create_bucket("outage")
        storage = make_storage(
            server, "outage", multipart_threshold_mb=5, part_size_mb=5, max_concurrency=1, max_attempts=1
        )

        def stop_after_first_part(**_kwargs):
            if server.running:
                server.stop()

        storage.client.meta.events.register("after-call.s3.UploadPart", stop_after_first_part)
        source = tmp_path / "big.bin"
        source.write_bytes(os.urandom(11 * MiB))
        with pytest.raises(StorageUnavailable, match="upload s3://outage/run/shards/big.safetensors"):
            storage.write_file("shards/big.safetensors", source)
        storage.client.meta.events.unregister("after-call.s3.UploadPart", stop_after_first_part)

        server.start()
        raw = server.client()
        assert len(raw.list_multipart_uploads(Bucket="outage").get("Uploads", [])) == 1
        assert not storage.exists("shards/big.safetensors")
        assert storage.abort_failed_uploads() == 0
        assert raw.list_multipart_uploads(Bucket="outage").get("Uploads", []) == []
        storage.write_file("shards/big.safetensors", source)  # and the retry goes through
        assert storage.read_bytes("shards/big.safetensors") == source.read_bytes()


def test_unreachable_endpoint_is_unavailable_not_permanent(s3_env):
    server = LoopbackS3()  # never started: connection refused
    storage = make_storage(server, "nowhere")
    with pytest.raises(StorageUnavailable, match="write s3://nowhere/run/k"):
        storage.write_bytes("k", b"x")


def test_missing_bucket_is_a_permanent_error_with_a_hint(s3_server, s3_env):
    storage = make_storage(s3_server, "no-such-bucket-here")
    with pytest.raises(StorageAccessError, match=r"NoSuchBucket.*bucket does not exist at this endpoint"):
        storage.write_bytes("k", b"x")


def test_missing_credentials_are_a_permanent_error(s3_server, s3_env, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    storage = make_storage(s3_server, "any-bucket")
    with pytest.raises(StorageAccessError, match="AWS_ACCESS_KEY_ID"):
        storage.write_bytes("k", b"x")


def test_unsupported_urls_are_config_errors():
    with pytest.raises(ConfigError, match="invalid bucket name"):
        open_storage("s3://Bad_Bucket/x")
    with pytest.raises(ConfigError, match="credentials must not appear"):
        open_storage("s3://AKIA:secret@bucket/x")


def test_local_copy_of_a_missing_object(s3_server, s3_bucket):
    with pytest.raises(FileNotFoundError):
        with make_storage(s3_server, s3_bucket).local_copy("shards/none.safetensors"):
            pass


def test_list_handles_many_pages(s3_server, s3_bucket):
    storage = make_storage(s3_server, s3_bucket)
    raw = s3_server.client()
    for index in range(1005):  # more than one ListObjectsV2 page (1000 keys)
        raw.put_object(Bucket=s3_bucket, Key=f"run/shards/{index:05d}.safetensors", Body=b"")
    keys = list(storage.list("shards/"))
    assert len(keys) == 1005 and keys[0] == "shards/00000.safetensors"


def test_local_copy_path_is_removed_afterwards(s3_server, s3_bucket):
    storage = make_storage(s3_server, s3_bucket)
    storage.write_bytes("shards/s.safetensors", b"abc")
    with storage.local_copy("shards/s.safetensors") as path:
        assert path.read_bytes() == b"abc"
        kept: Path = path
    assert not kept.exists()


def test_crc32c_needs_the_crt_package(s3_server, s3_bucket):
    try:
        import awscrt  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match="CRC32C needs the awscrt package"):
            make_storage(s3_server, s3_bucket, checksum_algorithm="CRC32C")
    else:
        storage = make_storage(s3_server, s3_bucket, checksum_algorithm="CRC32C")
        storage.write_bytes("k", b"crc32c")
        assert "ChecksumCRC32C" in s3_server.client().head_object(Bucket=s3_bucket, Key="run/k", ChecksumMode="ENABLED")


def test_shard_readers_fetch_byte_ranges_not_whole_objects(s3_server, s3_bucket, tmp_path):
    import torch

    from dflash_queue.shards.ranges import RangedObjectSource, open_source
    from dflash_queue.shards.reader import ShardIndex, read_sample
    from dflash_queue.shards.training import ExtractedSample, ShardInfo
    from dflash_queue.shards.training_writer import write_training_shard

    info = ShardInfo("tiny", (0, 1), 4, 256, "bfloat16", "abc", {})
    samples = [
        ExtractedSample(f"s{i}", torch.arange(100, dtype=torch.int32), torch.ones(100, dtype=torch.uint8),
                        torch.randn(100, 2, 256), "stop", False)
        for i in range(40)
    ]
    path = tmp_path / "shard.safetensors"
    write_training_shard(path, samples, info)
    storage = make_storage(s3_server, s3_bucket)
    storage.write_file("shards/x.safetensors", path)
    assert storage.read_range("shards/x.safetensors", 5, 100) == path.read_bytes()[5:105]
    with pytest.raises(StorageAccessError):
        storage.read_range("shards/x.safetensors", path.stat().st_size + 10, 4)

    fetched: list[int] = []
    read_range = storage.read_range
    storage.read_range = lambda key, start, length: fetched.append(length) or read_range(key, start, length)
    source = open_source(storage, "shards/x.safetensors")
    assert isinstance(source, RangedObjectSource)
    index = ShardIndex.load(source)
    sample = read_sample(index, source, 7, torch.float32)
    assert torch.equal(sample["hidden_states"], samples[7].hidden_states.to(torch.bfloat16).float())
    # The header (one 64 KiB probe), the offsets and one sample's rows: not the 4 MB object.
    assert sum(fetched) < 65536 + 2 * 100 * 2 * 256 * 2
