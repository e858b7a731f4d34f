"""Byte ranges of one stored object, read the cheapest way its storage allows.

* a local file: `os.preadv` straight into the tensor that will hold the bytes (no intermediate copy); the file
  descriptor is opened lazily and reopened in a new process, so a source copied into DataLoader workers (by fork
  or by pickling) never shares a descriptor with its parent;
* a storage with `read_range` (RangeReadable): one ranged read per call;
* any other storage: the whole object, read once and kept while the next reads hit the same object.
"""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path
from typing import Protocol

import torch

from dflash_queue.errors import ShardFormatError
from dflash_queue.shards.layout import HEADER_PROBE_BYTES, SafetensorsLayout, header_length, parse_header
from dflash_queue.storage.base import RangeReadable, Storage
from dflash_queue.storage.local import LocalStorage


class ByteSource(Protocol):
    where: str  # names the object in error messages

    def size(self) -> int: ...

    def read(self, start: int, length: int) -> torch.Tensor:
        """Exactly `length` bytes from `start`, as a uint8 tensor."""

    def close(self) -> None: ...


def open_source(storage: Storage, key: str) -> ByteSource:
    if isinstance(storage, LocalStorage):
        return LocalFileSource(storage.path_of(key))
    if isinstance(storage, RangeReadable):
        return RangedObjectSource(storage, key)
    return WholeObjectSource(storage, key)


class LocalFileSource:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.where = str(self.path)
        self._fd: int | None = None
        self._pid = 0

    def _descriptor(self) -> int:
        if self._fd is None or self._pid != os.getpid():
            # After a fork the inherited descriptor belongs to the parent: open our own (and leave theirs).
            try:
                self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            except FileNotFoundError:
                raise ShardFormatError(f"{self.where}: no such file") from None
            self._pid = os.getpid()
        return self._fd

    def size(self) -> int:
        return os.fstat(self._descriptor()).st_size

    def read(self, start: int, length: int) -> torch.Tensor:
        buffer = torch.empty(length, dtype=torch.uint8)
        if length == 0:
            return buffer
        view = buffer.numpy().data
        fd, done = self._descriptor(), 0
        while done < length:
            count = os.preadv(fd, [view[done:]], start + done)
            if count == 0:
                raise ShardFormatError(f"{self.where}: file ends at byte {start + done}, before {start + length}")
            done += count
        return buffer

    def close(self) -> None:
        if self._fd is not None and self._pid == os.getpid():
            os.close(self._fd)
        self._fd = None

    def __getstate__(self) -> dict:
        return {"path": self.path, "where": self.where, "_fd": None, "_pid": 0}

    def __del__(self) -> None:
        try:
            self.close()
        except OSError:
            pass


class RangedObjectSource:
    def __init__(self, storage: RangeReadable, key: str) -> None:
        self.storage = storage
        self.key = key
        self.where = f"{getattr(storage, 'url', storage)}/{key}"

    def size(self) -> int:
        return self.storage.size(self.key)  # type: ignore[attr-defined]

    def read(self, start: int, length: int) -> torch.Tensor:
        if length == 0:
            return torch.empty(0, dtype=torch.uint8)
        data = self.storage.read_range(self.key, start, length)
        if len(data) != length:
            raise ShardFormatError(f"{self.where}: asked for {length} bytes at {start}, got {len(data)}")
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)

    def close(self) -> None:
        pass


class WholeObjectSource:
    """For storages without ranged reads: correct, but each shard is fetched whole."""

    _last: tuple[tuple[int, str], torch.Tensor] | None = None  # one object per process
    _lock = threading.Lock()
    _warned: set[str] = set()

    def __init__(self, storage: Storage, key: str) -> None:
        self.storage = storage
        self.key = key
        self.where = f"{storage.url}/{key}"

    def _object(self) -> torch.Tensor:
        slot = (id(self.storage), self.key)
        with self._lock:
            cached = WholeObjectSource._last
            if cached is not None and cached[0] == slot:
                return cached[1]
        if type(self.storage).__name__ not in self._warned:
            self._warned.add(type(self.storage).__name__)
            warnings.warn(
                f"{type(self.storage).__name__} has no read_range: shards are read whole for random access",
                stacklevel=3,
            )
        data = torch.frombuffer(bytearray(self.storage.read_bytes(self.key)), dtype=torch.uint8)
        with self._lock:
            WholeObjectSource._last = (slot, data)
        return data

    def size(self) -> int:
        return int(self._object().shape[0])

    def read(self, start: int, length: int) -> torch.Tensor:
        data = self._object()
        if start + length > data.shape[0]:
            raise ShardFormatError(f"{self.where}: object ends at byte {data.shape[0]}, before {start + length}")
        return data[start : start + length].clone()

    def close(self) -> None:
        pass


def read_layout(source: ByteSource) -> SafetensorsLayout:
    """The header of a safetensors object: one read of HEADER_PROBE_BYTES, a second only for a larger header."""
    size = source.size()
    probe = source.read(0, min(size, HEADER_PROBE_BYTES)).numpy().tobytes()
    length = header_length(probe, where=source.where)
    if 8 + length > size:
        raise ShardFormatError(f"{source.where}: header of {length} bytes but the object holds only {size}")
    header = probe[8 : 8 + length]
    if len(header) < length:
        header += source.read(len(probe), 8 + length - len(probe)).numpy().tobytes()
    return parse_header(header, where=source.where, file_size=size)
