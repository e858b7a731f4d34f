"""Storage: the same self-check workers run at start-up (backend preflight, then a probe object written, read
back, listed and deleted), one doctor line per row."""

from __future__ import annotations

from dflash_queue.doctor.result import Check, Verdict
from dflash_queue.storage import open_storage
from dflash_queue.storage.checks import FAIL, OK, SKIP, WARN, check_storage
from dflash_queue.storage.config import StorageConfig

_VERDICTS: dict[str, Verdict] = {OK: "pass", WARN: "warn", FAIL: "fail"}


def check_configured_storage(settings: StorageConfig) -> list[Check]:
    try:
        storage = open_storage(settings)
    except Exception as exc:
        return [Check.failed("storage", f"{settings.url}: cannot open: {exc}")]
    return [
        Check(f"storage {row.check}", _VERDICTS[row.status], row.message)
        for row in check_storage(storage)
        if row.status != SKIP
    ]
