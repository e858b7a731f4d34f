from __future__ import annotations

from dflash_queue.ops.doctor.storage import PROBE_PREFIX, check_storage, probe_storage
from dflash_queue.storage.local import LocalStorage


def test_probe_round_trips_and_leaves_nothing(tmp_path):
    storage = LocalStorage(tmp_path / "out")
    check = probe_storage(storage)
    assert check.verdict == "pass"
    assert list(storage.list(PROBE_PREFIX)) == []


def test_unwritable_storage_fails_with_the_reason(tmp_path):
    blocker = tmp_path / "file-not-dir"
    blocker.write_text("x")
    check = check_storage(str(blocker / "out"))
    assert check.verdict == "fail"
    assert "cannot write" in check.detail and str(blocker) in check.detail
    assert check_storage("ftp://host/x").verdict == "fail"
