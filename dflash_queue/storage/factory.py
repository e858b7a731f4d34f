"""Pick a storage backend from a URL."""

from __future__ import annotations

from dflash_queue.errors import ConfigError
from dflash_queue.storage.base import Storage
from dflash_queue.storage.local import LocalStorage


def open_storage(url: str) -> Storage:
    if url.startswith("file://"):
        return LocalStorage(url.removeprefix("file://"))
    if "://" in url:
        scheme = url.split("://", 1)[0]
        raise ConfigError(f"storage.url: unsupported scheme {scheme!r} in {url!r}")
    return LocalStorage(url)
