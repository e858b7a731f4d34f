"""The storage protocol every backend implements."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol, runtime_checkable


@runtime_checkable
class Storage(Protocol):
    """Keyed blobs with atomic writes: a reader sees either nothing or the whole object under a key.

    Keys are '/'-separated relative paths such as ``shards/ab12.safetensors``.
    """

    url: str

    def exists(self, key: str) -> bool: ...

    def read_bytes(self, key: str) -> bytes: ...

    def write_bytes(self, key: str, data: bytes) -> None: ...

    def write_file(self, key: str, path: Path) -> None:
        """Store the contents of a local file under key (the file is left in place)."""

    def local_copy(self, key: str) -> AbstractContextManager[Path]:
        """A local path holding the object for the duration of the context (no copy when already local)."""

    def list(self, prefix: str = "") -> Iterator[str]:
        """Keys under a prefix, in no particular order."""

    def delete(self, key: str) -> None: ...

    def size(self, key: str) -> int: ...


@runtime_checkable
class RangeReadable(Protocol):
    """Optional capability: read part of an object without fetching all of it.

    Readers of training shards use it for random access (the safetensors header, then the byte ranges of one
    sample); a backend without it is read whole.
    """

    def read_range(self, key: str, start: int, length: int) -> bytes:
        """Exactly `length` bytes of the object from byte `start`; an error if the object is shorter."""
