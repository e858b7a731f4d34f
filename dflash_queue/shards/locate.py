"""Which training shards a user means: a shard file, a directory of them, a storage URL, or an open storage."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dflash_queue.errors import ShardFormatError
from dflash_queue.shards.keys import in_later_epoch, is_shard_key
from dflash_queue.storage.base import Storage
from dflash_queue.storage.factory import open_storage
from dflash_queue.storage.local import LocalStorage

ShardsArg = str | os.PathLike[str] | Storage


@dataclass(frozen=True)
class ShardSet:
    storage: Storage
    keys: tuple[str, ...]
    # The URL to open the storage again in another process, when it was opened from one.
    url: str | None
    # Whether the shards were found by listing (a directory, a storage), not named (a file, a shard URL, `keys`).
    listed: bool = False

    def where(self, key: str) -> str:
        return f"{self.storage.url}/{key}"


def locate_shards(target: ShardsArg, *, keys: Sequence[str] | None = None, prefix: str = "") -> ShardSet:
    """Shards named by `target`, in sorted key order (so every process numbers samples the same way).

    `target`: a `.safetensors` file, a directory searched recursively (a run's storage root finds its
    `shards/`), a storage URL (`s3://bucket/prefix`, a shard URL ending in `.safetensors`), or an open Storage.
    `keys` picks shards explicitly; `prefix` narrows the listing.
    """
    if isinstance(target, (str, os.PathLike)):
        text = os.fspath(target)
        if "://" in text and not text.startswith("file://"):
            storage_url, key = _split_object_url(text)
            return _from_storage(open_storage(storage_url), keys or ([key] if key else None), prefix, url=storage_url)
        path = Path(text.removeprefix("file://")).expanduser()
        if path.is_file():
            return ShardSet(LocalStorage(path.parent), (path.name,), url=str(path.parent.resolve()))
        if not path.is_dir():
            raise ShardFormatError(f"{path}: no such shard file or directory")
        return _from_storage(LocalStorage(path), keys, prefix, url=str(path.resolve()))
    return _from_storage(target, keys, prefix, url=None)


def _split_object_url(url: str) -> tuple[str, str | None]:
    if not is_shard_key(url):
        return url.rstrip("/"), None
    parent, _, name = url.rpartition("/")
    return parent, name


def _from_storage(storage: Storage, keys: Sequence[str] | None, prefix: str, *, url: str | None) -> ShardSet:
    listed = keys is None
    if keys is None:
        # Later epochs' copies of the run's shards (under epochs/) are read only when asked for by prefix.
        keys = sorted(
            k for k in storage.list(prefix) if is_shard_key(k) and (in_later_epoch(prefix) or not in_later_epoch(k))
        )
        if not keys:
            raise ShardFormatError(f"{storage.url}: no training shards under {prefix or 'the root'}")
    return ShardSet(storage, tuple(keys), url, listed)
