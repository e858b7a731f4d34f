"""Which of a set of training shards carry a suspect mark (shards/suspects.py), found from where each shard lies.

A mark lies at the root of the run's storage (`suspect/{epoch}/{shard id}.json`), beside `shards/` and `epochs/`,
whatever a reader was pointed at: the run's root (`shards/{id}.safetensors`), its `shards/` folder, one shard file
or URL, or a folder holding several runs. So each shard's run root, epoch and id are read from its full location
(its storage's URL and its key), and each root's marks are listed once. A shard outside a run's layout (not in a
`shards/` folder) carries no mark.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dflash_queue.errors import ShardFormatError
from dflash_queue.shards.keys import split_shard_path, suspect_key, suspect_marks_prefix
from dflash_queue.shards.suspects import SuspectMark
from dflash_queue.storage.base import Storage
from dflash_queue.storage.local import LocalStorage
from dflash_queue.storage.urls import scheme_of


class SuspectShardError(ShardFormatError):
    """A training shard the reference audit found suspect was asked for by name, or would be exported: no reader
    serves it as good until it is extracted again (`dflash-queue suspects reextract`). `marks`: key -> its mark."""

    def __init__(self, message: str, marks: dict[str, SuspectMark] | None = None) -> None:
        super().__init__(message)
        self.marks = dict(marks or {})

    @classmethod
    def named(cls, marks: dict[str, SuspectMark], where: str = "") -> SuspectShardError:
        """Suspect shards a reader was asked for by name."""
        shards = "; ".join(f"{key}: {mark.describe()}" for key, mark in marks.items())
        return cls(
            f"{where + ': ' if where else ''}{len(marks)} suspect shard(s) asked for by name ({shards}); their states "
            "may not be the model's: extract them again (`dflash-queue suspects reextract -c CONFIG`), or leave "
            "them out",
            marks,
        )


@dataclass(frozen=True)
class ShardPlace:
    """Where a training shard lies in a run's storage: the run's root (a storage, and the prefix of the root's keys
    in it), the shard's epoch and id."""

    root: Storage
    prefix: str
    epoch: int
    shard_id: str

    @property
    def mark_key(self) -> str:
        return self.prefix + suspect_key(self.shard_id, self.epoch)


def _reopen(storage: Storage, url: str) -> Storage | None:
    """A storage like `storage` at `url` (a folder above it), or None for a kind this cannot open there."""
    if isinstance(storage, LocalStorage):
        return LocalStorage(url or "/")
    if scheme_of(url) == "s3":
        try:
            from dflash_queue.storage.s3 import S3Storage
        except ModuleNotFoundError:  # no S3 support installed: `storage` is not an S3Storage
            return None
        if isinstance(storage, S3Storage):
            return S3Storage(url, storage.settings)
    return None


def shard_place(storage: Storage, key: str, opened: dict[str, Storage | None] | None = None) -> ShardPlace | None:
    """The run root, epoch and id of the training shard `key` in `storage`; None when it lies in no run's layout.
    `opened` keeps the storages opened above `storage` (one per root) across calls."""
    base = storage.url.rstrip("/").split("/")
    found = split_shard_path([*base, *key.split("/")])
    if found is None:
        return None
    root, epoch, shard_id = found
    if len(root) >= len(base):  # the run's root is `storage` or a folder in it
        return ShardPlace(storage, "".join(f"{s}/" for s in root[len(base):]), epoch, shard_id)
    url = "/".join(root)
    opened = {} if opened is None else opened
    if url not in opened:
        opened[url] = _reopen(storage, url)
    above = opened[url]
    return None if above is None else ShardPlace(above, "", epoch, shard_id)


def suspect_marks(storage: Storage, keys: Sequence[str]) -> dict[str, SuspectMark]:
    """key -> its suspect mark, for each of `keys` (training shards in `storage`) that carries one. Lists the marks
    of each run root once (one listing for a run's shards, whatever their number), then reads those that match."""
    opened: dict[str, Storage | None] = {}
    places = {key: place for key in keys if (place := shard_place(storage, key, opened)) is not None}
    listed: dict[tuple[int, str], set[str]] = {}
    found: dict[str, SuspectMark] = {}
    for key, place in places.items():
        root = (id(place.root), place.prefix)
        if root not in listed:
            listed[root] = set(place.root.list(suspect_marks_prefix(place.prefix)))
        if place.mark_key in listed[root]:
            found[key] = SuspectMark.from_json(place.root.read_bytes(place.mark_key), where=place.mark_key)
    return found
