"""Storage self-check: can this process write, read back (checksum verified), list and delete under the
configured location? Workers run it at start-up so that a missing bucket or denied access stops them at once,
not hours into a run; an operator's `doctor` shows the same rows."""

from __future__ import annotations

import os
import socket
import uuid
from typing import NamedTuple

from dflash_queue.errors import StorageCheckFailed

OK = "ok"
WARN = "warn"
FAIL = "fail"
SKIP = "skip"
PROBE_PREFIX = "_dfq_probe/"


class CheckResult(NamedTuple):
    check: str
    status: str  # ok | warn | fail | skip
    message: str


def check_storage(storage) -> list[CheckResult]:
    """(check, status, message) rows: backend-specific preflight, then a probe object written, read back,
    listed and deleted. After the first failure the remaining checks are reported as skipped."""
    results: list[CheckResult] = []
    describe = getattr(storage, "describe", None)
    results.append(CheckResult("location", OK, describe() if describe else storage.url))
    preflight = getattr(storage, "preflight_checks", None)
    if preflight is not None:
        results.extend(preflight())

    key = f"{PROBE_PREFIX}{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    payload = f"dflash-queue storage probe {uuid.uuid4()}\n".encode()
    written = False

    def write() -> str:
        nonlocal written
        storage.write_bytes(key, payload)
        written = True
        return f"wrote {key} ({len(payload)} bytes)"

    def read() -> str:
        data = storage.read_bytes(key)
        if data != payload:
            raise AssertionError(f"read back {len(data)} bytes that differ from the {len(payload)} written")
        return "read back, checksum verified"

    def listed() -> str:
        keys = set(storage.list(PROBE_PREFIX))
        if key not in keys:
            raise AssertionError(f"{key} was written but is not listed")
        return f"{key} is listed"

    def delete() -> str:
        storage.delete(key)
        if storage.exists(key):
            raise AssertionError(f"{key} still exists after delete")
        return "deleted"

    for name, step in (("write", write), ("read", read), ("list", listed), ("delete", delete)):
        if any(r.status == FAIL for r in results):
            results.append(CheckResult(name, SKIP, "skipped after an earlier failure"))
            continue
        try:
            results.append(CheckResult(name, OK, step()))
        except Exception as exc:  # every failure is a row of the report, whatever its type
            results.append(CheckResult(name, FAIL, f"{type(exc).__name__}: {exc}"))
    if written and any(r.check == "delete" and r.status != OK for r in results):
        try:
            storage.delete(key)
        except Exception:
            pass
    return results


def format_results(results: list[CheckResult]) -> str:
    width = max(len(r.check) for r in results)
    return "\n".join(f"  {r.check:<{width}}  {r.status.upper():<4}  {r.message}" for r in results)


def require_storage(storage) -> list[CheckResult]:
    """Run the checks; raise StorageCheckFailed listing them all when any failed."""
    results = check_storage(storage)
    if any(r.status == FAIL for r in results):
        raise StorageCheckFailed(f"storage check failed for {storage.url}:\n{format_results(results)}")
    return results
