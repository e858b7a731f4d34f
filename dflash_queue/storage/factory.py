"""Pick a storage backend from a URL (or a validated `[storage]` config section)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dflash_queue.errors import ConfigError
from dflash_queue.storage.base import Storage
from dflash_queue.storage.local import LocalStorage
from dflash_queue.storage.urls import check_storage_url, scheme_of

if TYPE_CHECKING:
    from dflash_queue.storage.config import StorageConfig


def open_storage(target: str | StorageConfig) -> Storage:
    """`target` is a path, ``file:///path``, ``s3://bucket/prefix``, or a StorageConfig (whose ``s3`` settings
    then apply). S3 support is imported only when an s3:// URL is opened."""
    url = target if isinstance(target, str) else target.url
    try:
        check_storage_url(url)
    except ValueError as exc:
        raise ConfigError(f"storage.url: {exc}") from None
    scheme = scheme_of(url)
    if scheme == "s3":
        try:
            from dflash_queue.storage.s3 import S3Storage
        except ModuleNotFoundError as exc:
            raise ConfigError(
                f"storage {url}: S3 needs {exc.name}, which the `s3` extra installs: pip install 'dflash-queue[s3]'"
            ) from None

        return S3Storage(url, None if isinstance(target, str) else target.s3)
    if scheme == "file":
        return LocalStorage(url.split("://", 1)[1])
    return LocalStorage(url)
