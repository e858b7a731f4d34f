"""The storage self-check that workers run at start-up (and `doctor` will show), on real storage."""

from __future__ import annotations

import pytest

from dflash_queue.errors import StorageCheckFailed
from dflash_queue.storage import LocalStorage
from dflash_queue.storage.checks import FAIL, OK, SKIP, check_storage, require_storage
from dflash_queue.storage.config import S3Config
from dflash_queue.storage.s3 import S3Storage


def s3(server, bucket: str) -> S3Storage:
    return S3Storage(f"s3://{bucket}/run", S3Config(endpoint_url=server.endpoint_url, max_attempts=2))


def rows(results):
    return {check: (status, message) for check, status, message in results}


def test_writable_bucket_passes_every_check_and_leaves_nothing(s3_server, s3_bucket):
    results = check_storage(s3(s3_server, s3_bucket))
    assert [r.check for r in results] == [
        "location", "credentials", "bucket", "multipart uploads", "write", "read", "list", "delete"
    ]
    assert all(r.status == OK for r in results), results
    table = rows(results)
    assert s3_server.endpoint_url in table["location"][1] and "credentials: env" in table["location"][1]
    assert table["credentials"][1] == "from env"
    assert s3_server.client().list_objects_v2(Bucket=s3_bucket).get("Contents", []) == []


def test_missing_bucket_fails_at_the_bucket_check(s3_server, s3_env):
    results = check_storage(s3(s3_server, "bucket-that-is-not-there"))
    table = rows(results)
    assert table["bucket"][0] == FAIL
    assert "'bucket-that-is-not-there' does not exist" in table["bucket"][1]
    assert [table[name][0] for name in ("write", "read", "list", "delete")] == [SKIP] * 4
    expected = r"(?s)storage check failed for s3://bucket-that-is-not-there/run/.*bucket +FAIL"
    with pytest.raises(StorageCheckFailed, match=expected):
        require_storage(s3(s3_server, "bucket-that-is-not-there"))


def test_missing_credentials_fail_first(s3_server, s3_env, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    table = rows(check_storage(s3(s3_server, "any-bucket")))
    assert table["credentials"][0] == FAIL and "AWS_ACCESS_KEY_ID" in table["credentials"][1]
    assert table["write"][0] == SKIP


def test_stale_multipart_uploads_are_a_warning(s3_server, s3_bucket):
    s3_server.client().create_multipart_upload(Bucket=s3_bucket, Key="run/shards/left.safetensors")
    table = rows(check_storage(s3(s3_server, s3_bucket)))
    assert table["multipart uploads"][0] == "warn" and "1 incomplete" in table["multipart uploads"][1]
    assert table["delete"][0] == OK


def test_local_storage_checks(tmp_path):
    assert all(r.status == OK for r in check_storage(LocalStorage(tmp_path / "root")))
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "_dfq_probe").write_text("a file where the probe directory should be")
    table = rows(check_storage(LocalStorage(blocked)))
    assert table["write"][0] == FAIL and "cannot write _dfq_probe/" in table["write"][1]
    assert table["read"][0] == SKIP
