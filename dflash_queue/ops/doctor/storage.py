"""Storage: write, read back, list and delete a probe object through the `Storage` protocol."""

from __future__ import annotations

import os
import socket
import uuid

from dflash_queue.ops.doctor.result import Check
from dflash_queue.storage import Storage, open_storage

PROBE_PREFIX = ".dfq-doctor"


def probe_storage(storage: Storage) -> Check:
    """Any backend: the probe must round-trip exactly and be gone after delete."""
    key = f"{PROBE_PREFIX}/{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}.probe"
    payload = os.urandom(4096)
    name = "storage writable"
    try:
        storage.write_bytes(key, payload)
        if storage.read_bytes(key) != payload:
            return Check.failed(name, f"{storage.url}: {key} read back different bytes than were written")
        if not storage.exists(key):
            return Check.failed(name, f"{storage.url}: {key} was written but exists() says it is not there")
        storage.delete(key)
        if storage.exists(key):
            return Check.failed(name, f"{storage.url}: {key} still exists after delete")
    except Exception as exc:  # any backend error is the finding
        return Check.failed(name, f"{storage.url}: {type(exc).__name__}: {exc}")
    return Check.passed(name, f"{storage.url}: wrote, read back and deleted a 4 KiB probe")


def check_storage(url: str) -> Check:
    try:
        storage = open_storage(url)
    except Exception as exc:
        return Check.failed("storage writable", f"{url}: cannot open: {exc}")
    return probe_storage(storage)
