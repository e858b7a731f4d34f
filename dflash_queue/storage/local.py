"""Local-filesystem storage: temp file in the target directory, fsync, then rename.

Errors that an operator or the system can clear while the job waits (a full or read-only volume, a directory
made unwritable, a network mount that went away) raise StorageUnavailable, which tasks retry with backoff;
anything else raises StorageError.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from dflash_queue.errors import StorageError, StorageUnavailable


def file_mode() -> int:
    """0666 less this process's umask, as open() would create a file."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask

# errno values of a store that may come back: permissions changed under the job, a volume remounted read-only
# or full (space or quota), an I/O error, a network file system's stale handle or lost server.
TRANSIENT_ERRNOS = frozenset(
    code
    for code in (
        errno.EACCES,
        errno.EPERM,
        errno.EROFS,
        errno.ENOSPC,
        errno.EDQUOT,
        errno.EIO,
        getattr(errno, "ESTALE", None),
        errno.ETIMEDOUT,
        errno.ENOTCONN,
    )
    if code is not None
)


def storage_error(url: str, action: str, key: str, exc: OSError) -> StorageError:
    """StorageUnavailable for an error that may clear (naming the path and errno), StorageError otherwise."""
    code = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    where = exc.filename or key
    message = f"{url}: cannot {action} {key}: {code} ({exc.strerror or exc}) on {where}"
    if exc.errno in TRANSIENT_ERRNOS:
        return StorageUnavailable(message)
    return StorageError(message)


class LocalStorage:
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).resolve()
        self.url = str(self.root)

    def path_of(self, key: str) -> Path:
        if not key or key.startswith("/") or ".." in key.split("/"):
            raise StorageError(f"invalid storage key {key!r}")
        return self.root / key

    def exists(self, key: str) -> bool:
        return self.path_of(key).is_file()

    def read_bytes(self, key: str) -> bytes:
        try:
            return self.path_of(key).read_bytes()
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise storage_error(self.url, "read", key, exc) from exc

    def read_range(self, key: str, start: int, length: int) -> bytes:
        if start < 0 or length < 0:
            raise StorageError(f"{self.url}: invalid byte range start={start} length={length} for {key}")
        try:
            with open(self.path_of(key), "rb") as handle:
                data = os.pread(handle.fileno(), length, start)
                while 0 < len(data) < length:  # one read returns at most ~2 GiB
                    more = os.pread(handle.fileno(), length - len(data), start + len(data))
                    if not more:
                        break
                    data += more
                size = os.fstat(handle.fileno()).st_size
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise storage_error(self.url, "read", key, exc) from exc
        if len(data) != length:
            raise StorageError(
                f"{self.url}: {key} holds {size} bytes, fewer than the range [{start}, {start + length}) asked"
            )
        return data

    def write_bytes(self, key: str, data: bytes) -> None:
        with self._atomic_target(key) as handle:
            handle.write(data)

    def write_file(self, key: str, path: Path) -> None:
        with self._atomic_target(key) as handle, open(path, "rb") as source:
            shutil.copyfileobj(source, handle, length=8 * 1024 * 1024)

    @contextmanager
    def local_copy(self, key: str) -> Iterator[Path]:
        path = self.path_of(key)
        if not path.is_file():
            raise FileNotFoundError(f"{self.url}: no object {key}")
        yield path

    def list(self, prefix: str = "") -> Iterator[str]:
        base = self.root / prefix if prefix else self.root
        if not base.exists():
            return
        directory = base if base.is_dir() else base.parent
        for path in directory.rglob("*"):
            if path.is_file() and not path.name.startswith(".tmp-"):
                key = path.relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    yield key

    def delete(self, key: str) -> None:
        """Remove the object, and the folders it leaves empty: as in an object store, a folder exists only while
        it holds objects (a storage probe leaves no `_dfq_probe/` behind)."""
        path = self.path_of(key)
        path.unlink(missing_ok=True)
        for folder in path.parents:
            if folder == self.root or not folder.is_relative_to(self.root):
                break
            try:
                folder.rmdir()
            except OSError:  # not empty (or already gone): nothing above it can be empty either
                break

    def size(self, key: str) -> int:
        return self.path_of(key).stat().st_size

    @contextmanager
    def _atomic_target(self, key: str) -> Iterator[BinaryIO]:
        target = self.path_of(key)
        for attempt in range(3):
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp_name = tempfile.mkstemp(prefix=".tmp-", dir=target.parent)
                break
            except FileNotFoundError as exc:  # a concurrent delete removed the folder as it emptied
                if attempt == 2:
                    raise storage_error(self.url, "write", key, exc) from exc
            except OSError as exc:
                raise storage_error(self.url, "write", key, exc) from exc
        try:
            with os.fdopen(fd, "wb") as handle:
                # mkstemp creates 0600; a stored file gets the mode any file of this process would (a trainer
                # running as another user reads it when the umask allows).
                os.fchmod(handle.fileno(), file_mode())
                yield handle
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp_name, target)
        except BaseException as exc:
            with _suppress_oserror():
                os.unlink(tmp_name)
            if isinstance(exc, OSError):
                raise storage_error(self.url, "write", key, exc) from exc
            raise

    def __repr__(self) -> str:
        return f"LocalStorage({self.url!r})"


@contextmanager
def _suppress_oserror() -> Iterator[None]:
    try:
        yield
    except OSError:
        pass
