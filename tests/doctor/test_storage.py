from __future__ import annotations

from dflash_queue.doctor.storage import check_configured_storage
from dflash_queue.storage.checks import PROBE_PREFIX
from dflash_queue.storage.config import StorageConfig
from dflash_queue.storage.local import LocalStorage


def test_probe_round_trips_and_leaves_nothing(tmp_path):
    checks = check_configured_storage(StorageConfig(url=str(tmp_path / "out")))
    assert checks and all(check.verdict == "pass" for check in checks)
    assert list(LocalStorage(tmp_path / "out").list(PROBE_PREFIX)) == []
    assert list((tmp_path / "out").iterdir()) == []  # not even an empty probe folder


def test_unwritable_storage_fails_with_the_reason(tmp_path):
    blocker = tmp_path / "file-not-dir"
    blocker.write_text("x")
    checks = check_configured_storage(StorageConfig(url=str(blocker / "out")))
    failed = [check for check in checks if check.verdict == "fail"]
    assert failed and str(blocker) in failed[0].detail


def test_s3_settings_reach_the_check(s3_server, s3_bucket):
    settings = StorageConfig.model_validate(
        {"url": f"s3://{s3_bucket}/run", "s3": {"endpoint_url": s3_server.endpoint_url}}
    )
    checks = check_configured_storage(settings)
    assert checks and all(check.verdict == "pass" for check in checks), checks
    missing = StorageConfig.model_validate(
        {"url": "s3://bucket-nobody-made/run", "s3": {"endpoint_url": s3_server.endpoint_url, "max_attempts": 1}}
    )
    assert any(check.verdict == "fail" and "bucket-nobody-made" in check.detail for check in check_configured_storage(missing))
